"""Whether a committed checkpoint fits the model a server was started with."""

from __future__ import annotations

import json
from pathlib import Path

from engine.inference.weight_folders import read_signature, signature_mismatch
from engine.local_checkpoints import CheckpointError
from storage.tensor_files import ties_word_embeddings


def check_compatible(model_folder: Path, checkpoint: Path) -> None:
    """Raise `CheckpointError` unless `checkpoint` has the served model's tensors and shapes."""
    try:
        found = read_signature(checkpoint)
    except (OSError, ValueError) as exc:
        raise CheckpointError(str(exc)) from exc
    problem = signature_mismatch(
        read_signature(model_folder),
        found,
        tied=ties_word_embeddings(json.loads((model_folder / "config.json").read_text())),
    )
    if problem:
        raise CheckpointError(f"checkpoint {checkpoint} does not fit the served model: {problem}")
