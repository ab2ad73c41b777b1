"""Committed checkpoints as local folders the servers can read, and whether they fit the model.

vLLM workers load weights from a local path. A checkpoint named by a remote URI (`s3://...`,
`gs://...`, `memory://...`) is fetched with the storage layer's `fetch_checkpoint` (every file
verified against the step's `_COMMITTED` marker, trainer state left behind, the folder swapped
in whole) into a cache folder named by the URI's hash; a `file://` URI or a bare path is used
where it lies.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from engine.inference.reload_ext import read_signature, signature_mismatch
from storage.backends import split_uri
from storage.checkpoints import fetch_checkpoint
from storage.commit import MARKER
from storage.layout import RunLayout
from storage.store import ObjectStore


class CheckpointError(ValueError):
    """A checkpoint that cannot be served: missing, uncommitted, corrupt, or for another model."""


def checkpoint_step(location: str) -> int | None:
    """The step in a `.../step_000042` location, or None."""
    return RunLayout.parse_step(location.rstrip("/").rsplit("/", 1)[-1])


#: Where servable folders live below a run root: resume checkpoints and policy versions.
_PARENTS = (RunLayout.CHECKPOINTS, RunLayout.POLICIES)


def _fetch(uri: str, cache_dir: Path) -> Path:
    """Download the committed checkpoint at `uri` into the cache (reused when already there)."""
    location = uri.rstrip("/")
    for parent in _PARENTS:
        root, _, step_name = location.rpartition(f"/{parent}/")
        step = RunLayout.parse_step(step_name)
        if root and step is not None:
            break
    else:
        raise CheckpointError(
            f"remote checkpoint {uri} must be <run root>/{{{','.join(_PARENTS)}}}/step_NNNNNN"
        )
    target = cache_dir / "checkpoints" / hashlib.sha256(uri.encode()).hexdigest()[:16]
    target.parent.mkdir(parents=True, exist_ok=True)
    return fetch_checkpoint(ObjectStore(root), step, target, parent=parent)


def local_checkpoint(checkpoint: str | os.PathLike[str], cache_dir: Path) -> Path:
    """A local folder holding `checkpoint` (a path or a storage URI of a committed step)."""
    location = os.fspath(checkpoint)
    protocol, path = split_uri(location)
    if protocol != "file":
        return _fetch(location, cache_dir)
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {location} does not exist")
    if location.startswith("file://") and not (folder / MARKER).is_file():
        raise CheckpointError(f"checkpoint {location} is not committed (no {MARKER})")
    return folder


def ties_embeddings(model_folder: Path) -> bool:
    """Whether the model's config ties the output layer to the input embedding."""
    config = json.loads((model_folder / "config.json").read_text())
    text_config = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", text_config.get("tie_word_embeddings", False)))


def check_compatible(model_folder: Path, checkpoint: Path) -> None:
    """Raise `CheckpointError` unless `checkpoint` has the served model's tensors and shapes."""
    try:
        found = read_signature(checkpoint)
    except (OSError, ValueError) as exc:
        raise CheckpointError(str(exc)) from exc
    problem = signature_mismatch(
        read_signature(model_folder), found, tied=ties_embeddings(model_folder)
    )
    if problem:
        raise CheckpointError(f"checkpoint {checkpoint} does not fit the served model: {problem}")
