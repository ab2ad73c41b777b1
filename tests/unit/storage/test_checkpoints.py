"""Checkpoints: folders transformers loads as they are, trainer state, retention."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from storage.checkpoints import (
    apply_retention,
    copy_local_checkpoint,
    fetch_checkpoint,
    load_checkpoint_weights,
    load_trainer_state,
    log_commit,
    logged_commits,
    require_committed,
    write_checkpoint,
)
from storage.commit import MARKER, committed_steps, read_commit
from storage.errors import CorruptObjectError, NotCommittedError
from storage.layout import RunLayout
from storage.retention import steps_to_delete
from storage.store import ObjectStore
from storage.tensor_files import ties_word_embeddings

GENERATION_CONFIG = b'{"do_sample": true, "temperature": 0.7}'


@pytest.fixture(scope="module")
def tiny_model() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=True,
    )
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _logits(model: transformers.PreTrainedModel) -> torch.Tensor:
    tokens = torch.arange(0, 252, 7).reshape(2, -1)
    with torch.no_grad():
        return model(input_ids=tokens).logits


def _write(store: ObjectStore, model: transformers.PreTrainedModel, step: int, **kwargs):
    return write_checkpoint(
        store,
        step,
        weights=model.state_dict(),
        config=model.config.to_dict(),
        files={"generation_config.json": GENERATION_CONFIG},
        **kwargs,
    )


@pytest.mark.parametrize("max_shard_bytes", [2**30, 40_000], ids=["single", "sharded"])
def test_transformers_loads_the_fetched_folder_exactly(
    store: ObjectStore,
    tiny_model: transformers.PreTrainedModel,
    tmp_path: Path,
    max_shard_bytes: int,
) -> None:
    record = _write(store, tiny_model, 4, max_shard_bytes=max_shard_bytes)
    assert record.meta["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    local = fetch_checkpoint(store, 4, tmp_path / "cache" / "step_000004")
    names = sorted(p.name for p in local.iterdir())
    if max_shard_bytes == 40_000:
        assert "model.safetensors.index.json" in names
        index = json.loads((local / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        assert "lm_head.weight" not in index["weight_map"]
    else:
        assert "model.safetensors" in names
    assert (local / "generation_config.json").read_bytes() == GENERATION_CONFIG

    loaded = transformers.AutoModelForCausalLM.from_pretrained(local).eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(_logits(loaded), _logits(tiny_model))
    assert loaded.generation_config.temperature == 0.7


def test_raw_weights_round_trip_with_ties_restored(
    memory_store: ObjectStore, tiny_model: transformers.PreTrainedModel, tmp_path: Path
) -> None:
    _write(memory_store, tiny_model, 1, max_shard_bytes=40_000)
    weights = load_checkpoint_weights(fetch_checkpoint(memory_store, 1, tmp_path / "c"))
    original = tiny_model.state_dict()
    assert weights.keys() == original.keys()
    assert all(torch.equal(weights[name], original[name]) for name in original)
    assert weights["lm_head.weight"] is weights["model.embed_tokens.weight"]


def test_untied_shared_memory_is_stored_as_copies(
    memory_store: ObjectStore, tmp_path: Path
) -> None:
    base = torch.arange(12, dtype=torch.float32)
    weights = {"a": base, "b": base, "c": base[:6].view(2, 3), "t": base.view(3, 4).t()}
    write_checkpoint(memory_store, 0, weights=weights, config={"model_type": "test"})
    loaded = load_checkpoint_weights(fetch_checkpoint(memory_store, 0, tmp_path / "c"))
    assert all(torch.equal(loaded[name], weights[name]) for name in weights)
    assert loaded["a"].data_ptr() != loaded["b"].data_ptr()


def test_trainer_state_round_trips_without_pickles(
    memory_store: ObjectStore, tiny_model: transformers.PreTrainedModel, tmp_path: Path
) -> None:
    state = {
        "optimizer.exp_avg.model.norm.weight": torch.randn(64),
        "rng.torch": torch.get_rng_state(),
    }
    progress = {"step": 9, "scheduler": {"last_epoch": 9}, "samples_seen": 1152}
    _write(memory_store, tiny_model, 9, trainer_state=state, progress=progress)
    lean = fetch_checkpoint(memory_store, 9, tmp_path / "c")
    assert not (lean / "trainer").exists()  # inference does not download optimizer state
    with pytest.raises(FileNotFoundError, match="trainer_state=True"):
        load_trainer_state(lean)
    full = fetch_checkpoint(memory_store, 9, tmp_path / "c", trainer_state=True)
    restored = load_trainer_state(full)
    assert restored.progress == progress
    assert restored.tensors.keys() == state.keys()
    assert all(torch.equal(restored.tensors[k], state[k]) for k in state)
    assert not list(full.rglob("*.pt")) and not list(full.rglob("*.bin"))


def test_fetch_reuses_a_verified_copy_and_replaces_a_stale_one(
    memory_store: ObjectStore, tiny_model: transformers.PreTrainedModel, tmp_path: Path
) -> None:
    _write(memory_store, tiny_model, 1)
    local = fetch_checkpoint(memory_store, 1, tmp_path / "c")
    weights_file = local / "model.safetensors"
    inode = weights_file.stat().st_ino
    assert fetch_checkpoint(memory_store, 1, local) == local
    assert weights_file.stat().st_ino == inode  # reused, not downloaded again

    _write(memory_store, tiny_model, 2, max_shard_bytes=40_000)
    fetch_checkpoint(memory_store, 2, local)  # same folder, another checkpoint
    assert not weights_file.exists()  # no file of step 1 is left to confuse a loader
    assert read_commit(memory_store, RunLayout.checkpoint_dir(2)).step == 2
    assert json.loads((local / MARKER).read_text())["step"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["c"]  # no staging folders left behind


def test_fetch_refuses_corrupt_objects_and_leaves_no_folder(
    memory_store: ObjectStore, tiny_model: transformers.PreTrainedModel, tmp_path: Path
) -> None:
    _write(memory_store, tiny_model, 3)
    path = f"{RunLayout.checkpoint_dir(3)}/model.safetensors"
    data = bytearray(memory_store.read_bytes(path))
    data[-1] ^= 0x01
    memory_store.write_bytes(path, bytes(data))
    with pytest.raises(CorruptObjectError) as info:
        fetch_checkpoint(memory_store, 3, tmp_path / "c")
    assert info.value.uri == memory_store.url(path)
    assert list(tmp_path.iterdir()) == []


def test_fetch_needs_a_commit_and_a_folder_of_its_own(
    memory_store: ObjectStore, tiny_model: transformers.PreTrainedModel, tmp_path: Path
) -> None:
    with pytest.raises(NotCommittedError):
        fetch_checkpoint(memory_store, 5, tmp_path / "c")
    _write(memory_store, tiny_model, 5)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    with pytest.raises(ValueError, match="not a fetched checkpoint"):
        fetch_checkpoint(memory_store, 5, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "precious"


def test_a_local_copy_outlives_its_source_and_refuses_a_source_changed_under_it(
    file_store: ObjectStore, tiny_model: transformers.PreTrainedModel, tmp_path: Path
) -> None:
    _write(file_store, tiny_model, 1, progress={"step": 1})
    source = Path(file_store.url(RunLayout.checkpoint_dir(1)).removeprefix("file://"))
    record = copy_local_checkpoint(source, tmp_path / "copy")
    assert record == read_commit(file_store, RunLayout.checkpoint_dir(1))
    assert not (tmp_path / "copy" / "trainer").exists()  # servers read no trainer state
    weights = (tmp_path / "copy" / "model.safetensors").read_bytes()

    # The step is deleted and written again (a resumed trainer): the copy is unchanged.
    file_store.delete(RunLayout.checkpoint_dir(1))
    assert (tmp_path / "copy" / "model.safetensors").read_bytes() == weights

    # A source whose files no longer match its marker (caught mid-rewrite) is not copied.
    _write(file_store, tiny_model, 2)
    source = Path(file_store.url(RunLayout.checkpoint_dir(2)).removeprefix("file://"))
    data = bytearray((source / "model.safetensors").read_bytes())
    data[-1] ^= 0x01
    (source / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CorruptObjectError):
        copy_local_checkpoint(source, tmp_path / "copy")
    assert (tmp_path / "copy" / "model.safetensors").read_bytes() == weights
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy", "root"]  # no staging left
    with pytest.raises(NotCommittedError):
        copy_local_checkpoint(tmp_path / "root", tmp_path / "other")


def test_writer_refuses_to_overwrite_its_own_files(memory_store: ObjectStore) -> None:
    for name in ["config.json", "model.safetensors", "trainer/progress.json", MARKER]:
        with pytest.raises(ValueError, match="would replace"):
            write_checkpoint(
                memory_store,
                0,
                weights={"w": torch.ones(1)},
                config={"model_type": "t"},
                files={name: b"{}"},
            )
    with pytest.raises(ValueError, match="model_type"):
        write_checkpoint(memory_store, 0, weights={"w": torch.ones(1)}, config={})


def test_retention_keeps_the_newest_and_the_milestones(
    memory_store: ObjectStore, tmp_path: Path
) -> None:
    for step in range(1, 11):
        write_checkpoint(
            memory_store, step, weights={"w": torch.full((2,), step)}, config={"model_type": "t"}
        )
    memory_store.write_bytes(f"{RunLayout.checkpoint_dir(11)}/model.safetensors", b"partial")
    deleted = apply_retention(memory_store, keep_last=2, keep_every=4, protect={3})
    assert deleted == [1, 2, 5, 6, 7]
    assert committed_steps(memory_store, RunLayout.CHECKPOINTS) == [3, 4, 8, 9, 10]
    assert memory_store.list(RunLayout.CHECKPOINTS) == [
        RunLayout.step_name(step) for step in (3, 4, 8, 9, 10, 11)
    ]  # the uncommitted step 11 may be mid-write: it is not touched
    assert apply_retention(memory_store, keep_last=None) == []


def test_the_commit_log_outlives_retention_and_names_why_a_step_is_gone(
    memory_store: ObjectStore,
) -> None:
    for step in (1, 2, 3):
        write_checkpoint(
            memory_store, step, weights={"w": torch.ones(2)}, config={"model_type": "t"}
        )
        log_commit(memory_store, step)
        apply_retention(memory_store, keep_last=1)
    assert committed_steps(memory_store, RunLayout.CHECKPOINTS) == [3]
    assert logged_commits(memory_store) == [1, 2, 3]
    require_committed(memory_store, 3)
    with pytest.raises(NotCommittedError, match=r"deleted by retention.*keep_last"):
        require_committed(memory_store, 2)
    with pytest.raises(NotCommittedError, match="never committed"):
        require_committed(memory_store, 7)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"keep_last": 3}, [1, 2]),
        ({"keep_last": 1, "keep_every": 2}, [1, 3]),
        ({"keep_last": 1, "protect": [1]}, [2, 3, 4]),
        ({"keep_last": None, "keep_every": 2}, []),
    ],
)
def test_steps_to_delete(kwargs: dict, expected: list[int]) -> None:
    assert steps_to_delete([5, 1, 4, 2, 3], **kwargs) == expected


def test_retention_never_deletes_the_newest_step() -> None:
    with pytest.raises(ValueError, match="keep_last"):
        steps_to_delete([1, 2], keep_last=0)


def _every_dtype() -> dict[str, torch.Tensor]:
    """One tensor of every dtype the streamed writer knows, plus scalars and empty shapes."""
    from storage.tensor_files import _dtypes

    generator = torch.Generator().manual_seed(3)
    tensors: dict[str, torch.Tensor] = {}
    for number, dtype in enumerate(_dtypes()):
        values = torch.randn(3, 5, generator=generator) * 10
        if dtype.is_complex:
            tensors[f"w{number % 3}.{dtype}"] = torch.complex(values, values).to(dtype)
        else:
            tensors[f"w{number % 3}.{dtype}"] = values.to(dtype)
    tensors["scalar.bf16"] = torch.tensor(2.5, dtype=torch.bfloat16)
    tensors["scalar.i64"] = torch.tensor(7)
    tensors["empty"] = torch.zeros(0, 4)
    tensors["empty.bf16"] = torch.zeros(3, 0, dtype=torch.bfloat16)
    tensors["naïve"] = torch.ones(2, dtype=torch.bfloat16)
    return tensors


@pytest.mark.parametrize("metadata", [{"format": "pt"}, None], ids=["metadata", "none"])
def test_streamed_safetensors_are_the_bytes_safetensors_writes(metadata: dict | None) -> None:
    from safetensors.torch import save

    from storage.tensor_files import safetensors_pieces

    tensors = _every_dtype()
    streamed = b"".join(bytes(piece) for piece in safetensors_pieces(tensors, metadata))
    assert streamed == save(tensors, metadata=metadata)


def test_streamed_checkpoint_loads_back_equal_with_safetensors(
    store: ObjectStore, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    tensors = _every_dtype()
    embed = torch.randn(16, 8).to(torch.bfloat16)
    weights = {**tensors, "model.embed_tokens.weight": embed, "lm_head.weight": embed}
    config = {"model_type": "test", "tie_word_embeddings": True}
    record = write_checkpoint(store, 2, weights=weights, config=config)
    assert record.meta["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    local = fetch_checkpoint(store, 2, tmp_path / "c")
    loaded = load_file(local / "model.safetensors")
    assert loaded.keys() == weights.keys() - {"lm_head.weight"}
    for name, tensor in loaded.items():
        assert tensor.dtype == weights[name].dtype and tensor.shape == weights[name].shape
        assert torch.equal(tensor, weights[name]), name
    restored = load_checkpoint_weights(local)
    assert restored["lm_head.weight"] is restored["model.embed_tokens.weight"]


def test_streamed_shards_load_back_equal_with_safetensors(
    file_store: ObjectStore, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    tensors = _every_dtype()
    write_checkpoint(file_store, 3, weights=tensors, config={"model_type": "t"}, max_shard_bytes=64)
    local = fetch_checkpoint(file_store, 3, tmp_path / "c")
    index = json.loads((local / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded: dict[str, torch.Tensor] = {}
    for file_name in set(index["weight_map"].values()):
        loaded.update(load_file(local / file_name))
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[name], tensors[name]) for name in tensors)


@pytest.mark.parametrize(
    ("config", "tied"),
    [
        (transformers.Qwen3Config(tie_word_embeddings=True).to_dict(), True),
        (transformers.Qwen3Config(tie_word_embeddings=False).to_dict(), False),
        ({"text_config": {"tie_word_embeddings": True}}, True),  # a multimodal config
        ({"tie_word_embeddings": False, "text_config": {"tie_word_embeddings": True}}, False),
        ({}, False),
    ],
)
def test_one_rule_says_whether_the_head_is_the_embedding(config: dict, tied: bool) -> None:
    assert ties_word_embeddings(config) is tied


def test_a_head_tied_in_the_text_config_is_stored_once(
    memory_store: ObjectStore, tmp_path: Path
) -> None:
    embedding = torch.randn(8, 4)
    weights = {"model.embed_tokens.weight": embedding, "lm_head.weight": embedding}
    config = {"model_type": "test", "text_config": {"tie_word_embeddings": True}}
    record = write_checkpoint(memory_store, 0, weights=weights, config=config)
    assert record.meta["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    loaded = load_checkpoint_weights(fetch_checkpoint(memory_store, 0, tmp_path / "c"))
    assert loaded["lm_head.weight"] is loaded["model.embed_tokens.weight"]
