"""Policy versions: every RL step, in the serving dtype, apart from resume checkpoints; exact
deltas between full versions; a resumed trainer's lineage replaces what its dead predecessor
published past its checkpoint."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.models import write_tiny_model
from engine.run import local_run_dir
from engine.run import run_store as open_run_store
from engine.trainer.pool import run_trainer
from engine.trainer.worker import run_stage
from storage.checkpoints import WEIGHTS_STEM, fetch_checkpoint
from storage.commit import committed_steps, read_commit
from storage.errors import PermanentStorageError
from storage.layout import RunLayout
from storage.metrics import read_metrics
from storage.policies import load_policy_weights
from storage.tensor_files import load_tensor_files
from tests.integration.trainer.conftest import make_config, write_steps
from tests.unit.trainer.conftest import SPEC


@pytest.fixture(scope="module")
def bf16_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tests' tiny model with a bf16 config: servers load it in bf16, trainers in fp32."""
    spec = dataclasses.replace(SPEC, dtype="bfloat16")
    return write_tiny_model(tmp_path_factory.mktemp("bf16-model"), spec)


def stored(config, step: int, parent: str) -> dict[str, torch.Tensor]:
    """A resume checkpoint's weights, or a policy version's (rebuilt from its chain)."""
    if parent == RunLayout.POLICIES:
        return load_policy_weights(open_run_store(config), step)
    with tempfile.TemporaryDirectory() as tmp:
        folder = fetch_checkpoint(open_run_store(config), step, Path(tmp) / "f", parent=parent)
        return load_tensor_files(folder, WEIGHTS_STEM)  # one file, or one per rank


def assert_versions_are_the_masters_cast(config, steps: range) -> None:
    for step in steps:
        masters, policy = stored(config, step, "checkpoints"), stored(config, step, "policies")
        assert policy.keys() == masters.keys()
        for name, tensor in policy.items():
            assert tensor.dtype == torch.bfloat16 and masters[name].dtype == torch.float32
            assert torch.equal(tensor, masters[name].to(torch.bfloat16)), (step, name)


def test_every_step_publishes_the_weights_in_the_serving_dtype(
    tmp_path: Path, bf16_model_dir: Path
) -> None:
    config = make_config(
        tmp_path,
        bf16_model_dir,
        "publish",
        max_steps=4,
        trainer={
            "checkpoint": {"interval": 3, "keep_last": None},
            "policy": {"keep_last": 3, "full_every": 1},
        },
    )
    write_steps(config, range(1, 5))
    run_stage(config, "rl")
    store = open_run_store(config)
    # Resume checkpoints on their own cadence (every 3 and the last); versions every step, all
    # full here, the newest three kept (version 0, the starting weights, was pruned).
    assert committed_steps(store, RunLayout.CHECKPOINTS) == [3, 4]
    assert committed_steps(store, RunLayout.POLICIES) == [2, 3, 4]
    assert_versions_are_the_masters_cast(config, range(3, 5))
    record = read_commit(store, RunLayout.policy_dir(4))
    assert record.meta["dtype"] == "bfloat16" and record.meta["lineage"] == 0
    assert record.meta["kind"] == "full"
    assert not any(name.startswith("trainer/") for name in record.files)
    with tempfile.TemporaryDirectory() as tmp:
        folder = fetch_checkpoint(store, 4, Path(tmp) / "p", parent=RunLayout.POLICIES)
        model = AutoModelForCausalLM.from_pretrained(str(folder))
        assert (folder / "tokenizer.json").is_file()
    assert model.dtype == torch.bfloat16
    lines = read_metrics(store, "rl")
    assert all(line["publish_wait_seconds"] >= 0 for line in lines)
    assert all(line["publish_snapshot_seconds"] > 0 for line in lines)
    # Every version after the first was written behind a step, and the next step says how long.
    assert all(line["publish_write_seconds"] > 0 for line in lines[1:])


def test_deltas_rebuild_every_version_exactly_and_retention_keeps_their_chains(
    tmp_path: Path, bf16_model_dir: Path
) -> None:
    """At a small learning rate few bf16 entries change: versions between full ones are deltas,
    and version + its chain is the masters' cast bit for bit at every step."""
    config = make_config(
        tmp_path,
        bf16_model_dir,
        "deltas",
        max_steps=5,
        trainer={
            "optim": {"lr": 1e-5},
            "checkpoint": {"interval": 1, "keep_last": None},
            "policy": {"keep_last": 2, "full_every": 3},
        },
    )
    write_steps(config, range(1, 6))
    run_stage(config, "rl")
    store = open_run_store(config)
    kinds = {
        step: read_commit(store, RunLayout.policy_dir(step)).meta["kind"]
        for step in committed_steps(store, RunLayout.POLICIES)
    }
    # Versions 0 and 3 full, 1-2 and 4-5 deltas; keeping the newest two (4, 5) keeps their
    # chain back to the full version 3.
    assert kinds == {3: "full", 4: "delta", 5: "delta"}
    delta = read_commit(store, RunLayout.policy_dir(5))
    assert list(delta.files) == ["delta-00000-of-00001.safetensors"]
    assert delta.meta["base"] == 4
    assert delta.meta["base_uid"] == read_commit(store, RunLayout.policy_dir(4)).meta["uid"]
    assert_versions_are_the_masters_cast(config, range(3, 6))
    lines = read_metrics(store, "rl")
    assert [line["policy_full"] for line in lines] == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert all(0 < line["policy_changed_fraction"] < 0.5 for line in lines)
    full_bytes = sum(d.size for d in read_commit(store, RunLayout.policy_dir(3)).files.values())
    assert delta.files["delta-00000-of-00001.safetensors"].size < full_bytes / 4


def test_a_step_that_changes_most_entries_is_a_delta_while_it_compresses_smaller(
    tmp_path: Path, bf16_model_dir: Path
) -> None:
    """Raw, a changed bf16 entry is 6 bytes against 2 for each entry of a full version, so a
    step that changed over a third of them was written full; compressed it is smaller (here
    0.3-0.55 of the weights at 74-100 % changed). The first delta is written to measure that,
    and the versions after it stay deltas."""
    config = make_config(
        tmp_path,
        bf16_model_dir,
        "dense",
        max_steps=4,
        trainer={
            "optim": {"lr": 1e-2},
            "checkpoint": {"interval": 1, "keep_last": None},
            "policy": {"keep_last": None, "full_every": 10},
        },
    )
    write_steps(config, range(1, 5))
    run_stage(config, "rl")
    store = open_run_store(config)
    lines = read_metrics(store, "rl")
    assert all(line["policy_changed_fraction"] > 0.5 for line in lines)
    assert [line["policy_full"] for line in lines] == [0.0, 0.0, 0.0, 0.0]
    (weights,) = [
        file.size
        for name, file in read_commit(store, RunLayout.policy_dir(0)).files.items()
        if name.endswith(".safetensors")
    ]
    sizes = [
        file.size
        for step in range(1, 5)
        for file in read_commit(store, RunLayout.policy_dir(step)).files.values()
    ]
    assert all(size < weights for size in sizes)
    assert_versions_are_the_masters_cast(config, range(1, 5))


def test_two_ranks_write_one_delta_file_each_and_rebuild_exactly(
    tmp_path: Path, bf16_model_dir: Path
) -> None:
    """Each gloo rank encodes the rows it owns into its own delta file, and writes the whole
    tensors it owns of a full version (a Hugging Face sharded folder); rank 0 commits both."""
    config = make_config(
        tmp_path,
        bf16_model_dir,
        "two-ranks",
        max_steps=3,
        trainer={
            "optim": {"lr": 1e-5},
            "checkpoint": {"interval": 1, "keep_last": None},
            "policy": {"keep_last": None, "full_every": 10},
            "parallel": {"nproc_per_node": 2, "backend": "gloo"},
        },
    )
    write_steps(config, range(1, 4))
    assert run_trainer(config, "rl") == 0
    store = open_run_store(config)
    for step in (1, 2, 3):
        record = read_commit(store, RunLayout.policy_dir(step))
        assert record.meta["kind"] == "delta"
        assert sorted(record.files) == [
            "delta-00000-of-00002.safetensors",
            "delta-00001-of-00002.safetensors",
        ]
    assert_versions_are_the_masters_cast(config, range(1, 4))
    full = read_commit(store, RunLayout.policy_dir(0))
    assert "config.json" in full.files and "tokenizer.json" in full.files
    assert sorted(n for n in full.files if n.startswith("model")) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        folder = fetch_checkpoint(store, 0, Path(tmp) / "p", parent=RunLayout.POLICIES)
        model = AutoModelForCausalLM.from_pretrained(str(folder))
        loaded = model.state_dict()
    for name, tensor in load_policy_weights(store, 0).items():
        assert torch.equal(loaded[name], tensor), name


def test_a_resumed_trainer_replaces_the_versions_past_its_checkpoint(
    tmp_path: Path, bf16_model_dir: Path
) -> None:
    trainer = {"checkpoint": {"interval": 2, "keep_last": None}, "policy": {"keep_last": None}}
    straight = make_config(tmp_path, bf16_model_dir, "straight", max_steps=4, trainer=trainer)
    write_steps(straight, range(1, 5))
    run_stage(straight, "rl")

    # The same run, dying after step 3: its checkpoint is step 2, its newest version step 3.
    dying = {**trainer, "rollout_timeout_s": 0.5}
    broken = make_config(tmp_path, bf16_model_dir, "resumed", max_steps=4, trainer=dying)
    write_steps(broken, range(1, 4))
    with pytest.raises(TimeoutError):
        run_stage(broken, "rl")
    store = open_run_store(broken)
    assert committed_steps(store, RunLayout.POLICIES) == [0, 1, 2, 3]
    assert read_commit(store, RunLayout.policy_dir(3)).meta["lineage"] == 0

    # As if it had also died writing version 4: half a file and a part of its own uid, no marker.
    debris = local_run_dir(broken) / RunLayout.policy_dir(4)
    debris.mkdir(parents=True)
    (debris / "delta-00000-of-00001.safetensors").write_bytes(b"\x00" * 100)
    (debris / "_PART-00001.json").write_text('{"uid": "dead", "files": {}}')
    assert committed_steps(store, RunLayout.POLICIES) == [0, 1, 2, 3]

    write_steps(broken, range(4, 5))
    resumed = make_config(tmp_path, bf16_model_dir, "resumed", max_steps=4, trainer=trainer)
    run_stage(resumed, "rl")
    assert committed_steps(store, RunLayout.POLICIES) == [0, 1, 2, 3, 4]
    # The half-written version 4 was cleared before the new lineage wrote its own.
    assert sorted(p.name for p in debris.iterdir()) == sorted(
        [*read_commit(store, RunLayout.policy_dir(4)).files, "_COMMITTED"]
    )
    # Version 3 was written again by the resumed lineage (from checkpoint 2), and every step was
    # trained once in the final lineage: the versions equal the uninterrupted run's, bit for bit.
    assert read_commit(store, RunLayout.policy_dir(3)).meta["lineage"] == 2
    assert read_commit(store, RunLayout.policy_dir(2)).meta["lineage"] == 0
    for step in (3, 4):
        want, have = stored(straight, step, "policies"), stored(resumed, step, "policies")
        for name in want:
            assert torch.equal(have[name], want[name]), (step, name)


def test_a_failed_background_write_fails_the_stage_and_the_rerun_completes(
    tmp_path: Path, bf16_model_dir: Path
) -> None:
    """Storage refusing the versions (here `policies` is a file, so no folder can be made
    under it): the error surfaces on the trainer's thread at the next publication, no version
    is committed, and once storage is back the same run completes every step once."""
    trainer = {"checkpoint": {"interval": 1, "keep_last": None}}
    config = make_config(tmp_path, bf16_model_dir, "refused", max_steps=2, trainer=trainer)
    write_steps(config, range(1, 3))
    store = open_run_store(config)
    blocker = Path(store.url(RunLayout.POLICIES).removeprefix("file://"))
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("not a folder")
    with pytest.raises(PermanentStorageError, match=store.url(RunLayout.POLICIES)) as failed:
        run_stage(config, "rl")
    assert "while writing a policy version in the background" in failed.value.__notes__[0]
    assert committed_steps(store, RunLayout.CHECKPOINTS) == []
    blocker.unlink()
    run_stage(config, "rl")
    assert committed_steps(store, RunLayout.POLICIES) == [0, 1, 2]
    assert committed_steps(store, RunLayout.CHECKPOINTS) == [1, 2]
    assert [line["step"] for line in read_metrics(store, "rl")] == [1, 2]
