"""Turn a configured model name into what `transformers` and vLLM load.

`primeflow/tiny-qwen3` (and the other names in `BUILTIN_MODELS`) is not on any hub: it names an
offline model of primeflow's own, which is built into the local cache on first use. Every other
name (a hub id or a local folder) is returned as it is and goes through the normal Hugging Face
loading path — except a local folder that is missing or holds no `config.json`, which is refused
here in one line naming the path: left to `transformers`, it surfaces as a hub-id validation
error or a multi-paragraph OSError that never says which folder was wrong.
"""

from __future__ import annotations

from pathlib import Path

from engine.config.model import looks_like_path
from engine.models.tiny import BUILTIN_MODELS, cached_tiny_model


class ModelPathError(FileNotFoundError):
    """A model named by a local path that does not exist or is not a model folder."""


def resolve_model(name: str, cache_dir: Path | None = None) -> str:
    """A local folder for a built-in offline model; `name` unchanged otherwise.

    Raises `ModelPathError` when `name` is a local path without a `config.json`.
    """
    if name in BUILTIN_MODELS:
        return str(cached_tiny_model(BUILTIN_MODELS[name], cache_dir=cache_dir))
    if looks_like_path(name):
        folder = Path(name).expanduser()
        if not (folder / "config.json").is_file():
            reason = "does not exist" if not folder.exists() else "has no config.json"
            raise ModelPathError(f"model path {name} {reason}")
    return name
