"""Weights & Biases logging of every metric line (docs/deployment.md); off unless a project
is named."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from engine.config.base import BaseConfig

#: The run modes a config may name (a subset of `wandb.init`'s).
WandbMode = Literal["online", "offline", "disabled"]


class WandbConfig(BaseConfig):
    """Where metric lines go in W&B. Needs the `wandb` extra: pip install 'primeflow[wandb]'."""

    project: Annotated[
        str | None, Field(description="W&B project; None turns W&B logging off.")
    ] = None
    entity: Annotated[
        str | None, Field(description="W&B team or user; None: the key's default entity.")
    ] = None
    mode: Annotated[
        WandbMode | None,
        Field(
            description=(
                "None: WANDB_MODE if set, else online when WANDB_API_KEY is set and offline "
                "(a local run folder to `wandb sync` later) when it is not."
            )
        ),
    ] = None
    tags: Annotated[list[str], Field(description="Tags of the W&B run.")] = []
