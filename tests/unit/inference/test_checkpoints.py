"""Checkpoints become local folders (remote ones fetched and verified once) and are checked
against the served model before any server is touched."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.inference.checkpoints import check_compatible
from engine.inference.weight_folders import read_signature, signature_mismatch
from engine.local_checkpoints import (
    CheckpointError,
    DamagedCheckpointError,
    checkpoint_step,
    local_checkpoint,
    version_chain,
)
from engine.models.tiny import TinyModelSpec, write_tiny_model
from storage.checkpoints import write_checkpoint
from storage.commit import commit_step
from storage.errors import CorruptObjectError, NotCommittedError
from storage.store import ObjectStore

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "tied": write_tiny_model(root / "tied"),
        "tied_other": write_tiny_model(root / "tied_other", TinyModelSpec(seed=3)),
        "untied": write_tiny_model(root / "untied", TinyModelSpec(tie_word_embeddings=False)),
        "wide": write_tiny_model(root / "wide", TinyModelSpec(hidden_size=192)),
        "deep": write_tiny_model(root / "deep", TinyModelSpec(num_layers=3)),
    }


def upload(store: ObjectStore, folder: Path, step_dir: str, step: int) -> None:
    for path in sorted(folder.iterdir()):
        store.upload_file(path, f"{step_dir}/{path.name}")
    commit_step(store, step_dir, [p.name for p in sorted(folder.iterdir())], step=step)


def test_step_comes_from_the_folder_name() -> None:
    assert checkpoint_step("s3://b/run/checkpoints/step_000042") == 42
    assert checkpoint_step("/runs/x/checkpoints/step_000007/") == 7
    assert checkpoint_step("/models/base") is None


def test_local_paths_are_used_where_they_lie(models: dict[str, Path], tmp_path: Path) -> None:
    assert local_checkpoint(models["tied"], tmp_path) == models["tied"].resolve()
    with pytest.raises(CheckpointError, match="does not exist"):
        local_checkpoint(tmp_path / "nope", tmp_path)


def test_file_uris_must_be_committed(models: dict[str, Path], tmp_path: Path) -> None:
    folder = shutil.copytree(models["tied"], tmp_path / "step_000001")
    with pytest.raises(CheckpointError, match="not committed"):
        local_checkpoint(f"file://{folder}", tmp_path)
    names = sorted(p.name for p in folder.iterdir())
    commit_step(ObjectStore(f"file://{tmp_path}"), folder.name, names, step=1)
    assert local_checkpoint(f"file://{folder}", tmp_path) == folder


def test_a_damaged_file_uri_checkpoint_is_refused_naming_the_file(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """Served in place, so checked in place: 4 KiB flipped, then a file deleted."""
    folder = shutil.copytree(models["tied"], tmp_path / "step_000001")
    names = sorted(p.name for p in folder.iterdir())
    commit_step(ObjectStore(f"file://{tmp_path}"), folder.name, names, step=1)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4096:] = bytes(b ^ 0xFF for b in data[-4096:])
    weights.write_bytes(bytes(data))
    with pytest.raises(DamagedCheckpointError, match=r"damaged.*model\.safetensors"):
        local_checkpoint(f"file://{folder}", tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(DamagedCheckpointError, match=r"model\.safetensors.*missing"):
        local_checkpoint(f"file://{folder}", tmp_path)


def test_remote_checkpoints_are_fetched_once_and_verified(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """A checkpoint as the trainer commits it: weights, config, tokenizer, trainer state."""
    folder = models["tied_other"]
    run = f"memory://ckpt-{uuid.uuid4().hex}/run"
    write_checkpoint(
        ObjectStore(run),
        5,
        weights=load_file(folder / "model.safetensors"),
        config=json.loads((folder / "config.json").read_text()),
        files={name: (folder / name).read_bytes() for name in TOKENIZER_FILES},
        trainer_state={"adam.exp_avg": torch.zeros(3)},
    )
    uri = f"{run}/checkpoints/step_000005"

    local = local_checkpoint(uri, tmp_path)
    assert read_signature(local) == read_signature(folder)
    assert not (local / "trainer").exists()  # inference needs no optimizer state
    for name in TOKENIZER_FILES:
        assert (local / name).read_bytes() == (folder / name).read_bytes()
    check_compatible(models["tied"], local)
    stamp = (local / "config.json").stat().st_mtime_ns
    assert local_checkpoint(uri, tmp_path) == local  # cached: not downloaded again
    assert (local / "config.json").stat().st_mtime_ns == stamp


def test_remote_checkpoints_must_follow_the_run_layout(tmp_path: Path) -> None:
    with pytest.raises(
        CheckpointError, match=r"must be <run root>/\{checkpoints,policies\}/step_NNNNNN"
    ):
        local_checkpoint("s3://bucket/models/latest", tmp_path)


def test_remote_corruption_and_missing_commits_are_refused(
    models: dict[str, Path], tmp_path: Path
) -> None:
    run = f"memory://ckpt-{uuid.uuid4().hex}/run"
    store = ObjectStore(run)
    upload(store, models["tied"], "checkpoints/step_000001", step=1)
    store.write_bytes("checkpoints/step_000001/model.safetensors", b"tampered")
    with pytest.raises(DamagedCheckpointError, match=r"model\.safetensors") as damaged:
        local_checkpoint(f"{run}/checkpoints/step_000001", tmp_path)
    assert isinstance(damaged.value.__cause__, CorruptObjectError)
    store.upload_file(models["tied"] / "config.json", "checkpoints/step_000002/config.json")
    with pytest.raises(DamagedCheckpointError, match="no _COMMITTED marker") as damaged:
        local_checkpoint(f"{run}/checkpoints/step_000002", tmp_path)
    assert isinstance(damaged.value.__cause__, NotCommittedError)
    assert not list((tmp_path / "checkpoints").iterdir())  # nothing half-fetched is left


def test_a_policy_chain_that_does_not_verify_is_damaged_not_merely_unservable(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """What a reader discards (`DamagedCheckpointError`) against what it only refuses: a
    version whose marker is gone, or a delta whose base is, cannot be rebuilt by anyone."""
    run = f"memory://ckpt-{uuid.uuid4().hex}/run"
    store = ObjectStore(run)
    upload(store, models["tied"], "policies/step_000001", step=1)
    commit_step(store, "policies/step_000002", [], step=2, meta={"kind": "delta", "base": 3})
    with pytest.raises(DamagedCheckpointError, match="version 2 is a delta on version 3, which"):
        version_chain(f"{run}/policies/step_000002", None)
    with pytest.raises(DamagedCheckpointError, match="step_000009 is not committed"):
        version_chain(f"{run}/policies/step_000009", None)
    assert version_chain(f"{run}/policies/step_000001", None) == [f"{run}/policies/step_000001"]
    with pytest.raises(CheckpointError) as refused:
        local_checkpoint(tmp_path / "nope", tmp_path)
    assert not isinstance(refused.value, DamagedCheckpointError)


def test_signature_lists_every_tensor_and_shape(models: dict[str, Path]) -> None:
    signature = read_signature(models["tied"])
    assert signature["model.embed_tokens.weight"] == (101, 128)
    assert signature["model.layers.1.mlp.down_proj.weight"] == (128, 384)
    assert "lm_head.weight" not in signature
    assert "lm_head.weight" in read_signature(models["untied"])


def test_sharded_checkpoints_follow_their_index(models: dict[str, Path], tmp_path: Path) -> None:
    folder = shutil.copytree(models["tied"], tmp_path / "sharded")
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / "stray.safetensors").write_bytes(b"not listed in the index, never read")
    index = {
        "weight_map": dict.fromkeys(
            read_signature(models["tied"]), "model-00001-of-00001.safetensors"
        )
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert read_signature(folder) == read_signature(models["tied"])


def test_truncated_and_missing_weights_are_reported(
    models: dict[str, Path], tmp_path: Path
) -> None:
    folder = shutil.copytree(models["tied"], tmp_path / "cut")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        read_signature(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        read_signature(folder)


def test_compatible_checkpoints_pass(models: dict[str, Path]) -> None:
    check_compatible(models["tied"], models["tied_other"])


@pytest.mark.parametrize(
    ("served", "checkpoint", "message"),
    [
        ("tied", "wide", "has shape [101, 192], expected [101, 128]"),
        ("tied", "deep", "unexpected tensors (first: model.layers.2."),
        ("untied", "tied", "missing 1 tensors (first: lm_head.weight)"),
    ],
)
def test_incompatible_checkpoints_are_refused(
    models: dict[str, Path], served: str, checkpoint: str, message: str
) -> None:
    with pytest.raises(CheckpointError, match="does not fit the served model") as error:
        check_compatible(models[served], models[checkpoint])
    assert message in str(error.value)


def test_a_tied_head_may_be_stored_or_not() -> None:
    base = {"model.embed_tokens.weight": (10, 4)}
    with_head = {**base, "lm_head.weight": (10, 4)}
    assert signature_mismatch(base, with_head, tied=True) is None
    assert signature_mismatch(with_head, base, tied=True) is None
    assert "missing 1 tensors (first: lm_head.weight)" in str(
        signature_mismatch(with_head, base, tied=False)
    )
