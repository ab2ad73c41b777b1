"""Which model a run trains and serves."""

from __future__ import annotations

import os
from typing import Annotated

from pydantic import Field

from engine.config.base import BaseConfig

#: The offline tiny model + tokenizer that primeflow builds itself (no hub needed); the default.
TINY_MODEL = "primeflow/tiny-qwen3"


class ModelConfig(BaseConfig):
    """The shared model; its name fills the trainer, inference and orchestrator sections."""

    name: Annotated[
        str,
        Field(
            min_length=1,
            description=(
                "Hugging Face hub id, local folder, or a built-in offline model: "
                f"'{TINY_MODEL}' (the default), 'primeflow/qwen3-char-76m' (the GPU demo) or "
                "'primeflow/qwen3-0.6b-body' (Qwen3-0.6B's shapes)."
            ),
        ),
    ] = TINY_MODEL
    revision: Annotated[str | None, Field(description="Hub revision (branch, tag or commit).")] = (
        None
    )
    trust_remote_code: Annotated[
        bool, Field(description="Allow the model's own Python code from the hub.")
    ] = False


def looks_like_path(name: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else (or anything that exists) is a path."""
    if os.path.exists(name):
        return True
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1
