"""Policy versions in a run: chains from a full version, lineages kept apart, retention."""

from __future__ import annotations

import pytest
import torch

from storage.checkpoints import write_checkpoint
from storage.commit import commit_step, committed_steps, delete_step
from storage.deltas import delta_between
from storage.errors import StepTimeoutError
from storage.layout import RunLayout
from storage.parts import wait_for_parts, write_part
from storage.policies import (
    chain,
    committed_version,
    discard_version,
    forget_after,
    is_published,
    load_policy_weights,
    prune_policies,
    write_delta_file,
)
from storage.store import ObjectStore

CONFIG = {"model_type": "qwen3", "tie_word_embeddings": False}


def weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 8, generator=generator).bfloat16()}


def full(store: ObjectStore, step: int, tensors: dict[str, torch.Tensor]) -> None:
    meta = {"kind": "full", "uid": f"u{step}", "full_every": 3}
    write_checkpoint(
        store, step, weights=tensors, config=CONFIG, parent=RunLayout.POLICIES, meta=meta
    )


def delta(store: ObjectStore, step: int, old, new, *, base_uid: str | None = None) -> None:
    step_dir = RunLayout.policy_dir(step)
    files = write_delta_file(
        store, step_dir, "delta-00000-of-00001.safetensors", delta_between(old, new)
    )
    meta = {
        "kind": "delta",
        "uid": f"u{step}",
        "full_every": 3,
        "base": step - 1,
        "base_uid": base_uid or f"u{step - 1}",
    }
    commit_step(store, step_dir, files, step=step, meta=meta)


@pytest.fixture
def run(memory_store: ObjectStore) -> ObjectStore:
    """Versions 0 (full), 1, 2 (deltas), 3 (full), 4 (delta): `full_every` 3."""
    history = [weights(seed) for seed in range(5)]
    full(memory_store, 0, history[0])
    delta(memory_store, 1, history[0], history[1])
    delta(memory_store, 2, history[1], history[2])
    full(memory_store, 3, history[3])
    delta(memory_store, 4, history[3], history[4])
    memory_store.history = history  # type: ignore[attr-defined]
    return memory_store


def test_a_chain_starts_at_a_full_version_or_after_the_one_held(run: ObjectStore) -> None:
    assert [v.step for v in chain(run, 2)] == [0, 1, 2]
    assert [v.step for v in chain(run, 4)] == [3, 4]
    assert [v.step for v in chain(run, 2, held_uid="u0")] == [1, 2]
    assert chain(run, 2, held_uid="u2") == []
    # Holding a version outside the chain changes nothing: the reader starts from the full one.
    assert [v.step for v in chain(run, 4, held_uid="u1")] == [3, 4]
    for step in range(5):
        assert torch.equal(load_policy_weights(run, step)["w"], run.history[step]["w"])


def test_a_delta_on_another_lineage_or_a_missing_base_is_refused(run: ObjectStore) -> None:
    history = run.history  # type: ignore[attr-defined]
    delta(run, 5, history[4], weights(5), base_uid="u4-of-a-dead-trainer")
    with pytest.raises(ValueError, match="another version 4"):
        chain(run, 5)
    delete_step(run, RunLayout.policy_dir(0))
    with pytest.raises(ValueError, match="version 0, which is not committed"):
        chain(run, 2)


def test_retention_keeps_the_chains_of_kept_versions(run: ObjectStore) -> None:
    # The newest two are 3 and 4: their chain starts at the full version 3.
    assert prune_policies(run, keep_last=2) == [0, 1, 2]
    assert committed_steps(run, RunLayout.POLICIES) == [3, 4]


def test_retention_keeps_a_kept_delta_whole(run: ObjectStore) -> None:
    # keep_every=2 keeps version 2, a delta: versions 0 and 1 stay for it.
    assert prune_policies(run, keep_last=1, keep_every=2) == []
    assert prune_policies(run, keep_last=1) == [0, 1, 2]


def test_retention_survives_a_kept_delta_whose_base_was_deleted(run: ObjectStore) -> None:
    """A broken chain keeps nothing alive but itself (a reader discards it): retention goes
    on instead of failing the trainer's publication."""
    delete_step(run, RunLayout.policy_dir(3))
    assert prune_policies(run, keep_last=1) == [0, 1, 2]
    assert committed_steps(run, RunLayout.POLICIES) == [4]


def test_a_resume_clears_exactly_the_versions_past_its_checkpoint(run: ObjectStore) -> None:
    assert forget_after(run, 2) == [3, 4]
    assert committed_steps(run, RunLayout.POLICIES) == [0, 1, 2]
    assert run.list(RunLayout.POLICIES) == [RunLayout.step_name(s) for s in (0, 1, 2)]
    assert forget_after(run, 2) == []
    assert forget_after(run, 0) == [1, 2]


def test_a_discarded_version_is_the_one_its_writer_no_longer_finds(run: ObjectStore) -> None:
    """The trainer republishes exactly when `is_published` says no; a reader discards only
    the write it failed on, never the same step written again since."""
    assert is_published(run, 4, "u4") and not is_published(run, 4, "u4-other")
    assert not discard_version(run, 4, "u4-of-an-older-write")
    assert committed_version(run, 4) is not None
    assert discard_version(run, 4, "u4")
    assert committed_version(run, 4) is None and not is_published(run, 4, "u4")
    assert not discard_version(run, 4, "u4")  # gone already: nothing to do
    # Its base and everything older stay servable.
    assert [v.step for v in chain(run, 3)] == [3]


def test_rank_zero_commits_only_the_parts_of_its_own_version(memory_store: ObjectStore) -> None:
    """A part left by a dead writer of the same step number (another uid) is not taken."""
    step_dir = RunLayout.policy_dir(7)
    (digest,) = write_delta_file(
        memory_store, step_dir, "x", delta_between(weights(0), weights(0))
    ).values()
    write_part(memory_store, step_dir, 1, {"old": digest}, uid="dead")
    with pytest.raises(StepTimeoutError, match="rank 1"):
        wait_for_parts(memory_store, step_dir, [1], uid="live", timeout_s=0.1)
    write_part(memory_store, step_dir, 1, {"new": digest}, uid="live")
    assert list(wait_for_parts(memory_store, step_dir, [1], uid="live", timeout_s=1)) == ["new"]
