"""Turn a configured model name into what `transformers` and vLLM load.

`primeflow/tiny-qwen3` is not on any hub: it names the offline tiny model, which is built into
the local cache on first use. Every other name (a hub id or a local folder) is returned as it is
and goes through the normal Hugging Face loading path.
"""

from __future__ import annotations

from pathlib import Path

from engine.config.model import TINY_MODEL
from engine.models.tiny import cached_tiny_model


def resolve_model(name: str, cache_dir: Path | None = None) -> str:
    """A local folder for the built-in tiny model; `name` unchanged otherwise."""
    if name == TINY_MODEL:
        return str(cached_tiny_model(cache_dir=cache_dir))
    return name
