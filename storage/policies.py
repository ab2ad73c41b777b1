"""Policy versions of a run (`<run>/policies/step_N/`): full or delta, their chains, retention.

A version is *full* (a Hugging Face folder of the weights in the serving dtype) or a *delta*
(`storage.deltas` files against the version before it). Its `_COMMITTED` meta says which:
`kind`, a `uid` of its own and, for a delta, the `base` step and the `base_uid` it was encoded
against. Readers follow the chain from a version back to a full one (or to a version they
already hold, by uid), so a delta is never applied to another lineage's version of the same
step number: after a trainer resumed from an older checkpoint the numbers repeat, the uids do
not.

Several trainer ranks write one version (`storage.parts`): each writes its own files and
part; rank 0 waits for every part, then commits them all in one marker.

A committed version can still turn out unusable: a file altered after its commit, or a delta
whose base was deleted. A reader that finds one discards it (`discard_version`), and the
trainer, which finds its newest version gone (`is_published`), publishes it again in full;
versions past a resume checkpoint belong to a dead trainer and are cleared (`forget_after`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from storage.commit import (
    FileDigest,
    HashingWriter,
    committed_steps,
    delete_step,
    read_commit,
    read_verified,
    write_hashed,
)
from storage.errors import NotCommittedError
from storage.layout import RunLayout, is_delta_file
from storage.paths import join
from storage.retention import steps_to_delete
from storage.store import ObjectStore

# Tensors (torch, `storage.deltas`) load where weights are read or written: a process that only
# places versions in a chain (a flow run's) never imports torch for it.
if TYPE_CHECKING:
    import torch

    from storage.deltas import Delta

FULL = "full"
DELTA = "delta"
#: Longest chain a reader follows before it calls the run broken (writers bound it by
#: `trainer.policy.full_every`, which is far below this).
_MAX_CHAIN = 10_000


@dataclass(frozen=True)
class VersionInfo:
    """What a reader needs to know of one committed version to place it in a chain."""

    step: int
    kind: str
    uid: str | None
    base: int | None = None
    base_uid: str | None = None

    @classmethod
    def from_meta(cls, step: int, meta: Mapping[str, Any]) -> VersionInfo:
        """Versions without `kind` (and resume checkpoints) are full."""
        return cls(
            step=step,
            kind=str(meta.get("kind", FULL)),
            uid=meta.get("uid"),
            base=meta.get("base"),
            base_uid=meta.get("base_uid"),
        )


def version_info(store: ObjectStore, step: int) -> VersionInfo:
    """The kind, uid and base of committed version `step` (`NotCommittedError` if none)."""
    return VersionInfo.from_meta(step, read_commit(store, RunLayout.policy_dir(step)).meta)


def chain(store: ObjectStore, step: int, *, held_uid: str | None = None) -> list[VersionInfo]:
    """The versions to apply, oldest first, to get version `step`.

    It starts at a full version, or just after the version whose uid is `held_uid` (what the
    reader already holds); empty when that is `step` itself. Raises `ValueError` when a delta's
    base is gone or is another lineage's version of that step.
    """
    versions: list[VersionInfo] = []
    current = version_info(store, step)
    while current.uid is None or current.uid != held_uid:
        versions.append(current)
        if current.kind == FULL or (held_uid is not None and current.base_uid == held_uid):
            break
        if current.base is None or len(versions) > _MAX_CHAIN:
            raise ValueError(f"policy version {current.step} is a delta without a usable base")
        try:
            base = version_info(store, current.base)
        except NotCommittedError:
            raise ValueError(
                f"policy version {current.step} is a delta on version {current.base}, "
                "which is not committed any more"
            ) from None
        if base.uid != current.base_uid:
            raise ValueError(
                f"policy version {current.step} is a delta on another version {current.base} "
                f"(uid {current.base_uid}) than the one committed now ({base.uid})"
            )
        current = base
    return versions[::-1]


def _needs(store: ObjectStore, step: int) -> set[int]:
    """The versions version `step` is rebuilt from; only itself when its chain is broken (a
    base deleted meanwhile: a reader discards it, so it keeps nothing else alive)."""
    try:
        return {version.step for version in chain(store, step)}
    except (ValueError, NotCommittedError):
        return {step}


def prune_policies(
    store: ObjectStore, *, keep_last: int | None, keep_every: int | None = None
) -> list[int]:
    """Delete old versions, but never one a kept version's chain needs; returns the deleted."""
    steps = committed_steps(store, RunLayout.POLICIES)
    doomed = steps_to_delete(steps, keep_last=keep_last, keep_every=keep_every)
    needed: set[int] = set()
    # Newest first: a chain runs back through the older kept versions, so theirs are known.
    for step in sorted(set(steps) - set(doomed), reverse=True):
        if step not in needed:
            needed.update(_needs(store, step))
    deleted = [step for step in doomed if step not in needed]
    for step in deleted:
        delete_step(store, RunLayout.policy_dir(step))
    return deleted


def forget_after(store: ObjectStore, step: int) -> list[int]:
    """Delete the committed versions newer than `step` (marker first); returns them.

    A trainer resumed from checkpoint `step` trains the steps after it again: the versions a
    dead trainer published past it are another lineage, which no server may load once the
    resumed stage starts.
    """
    newer = [s for s in committed_steps(store, RunLayout.POLICIES) if s > step]
    for stale in newer:
        delete_step(store, RunLayout.policy_dir(stale))
    return newer


def committed_version(store: ObjectStore, step: int) -> VersionInfo | None:
    """Version `step`'s kind, uid and base; None when it is not committed (any more)."""
    try:
        return version_info(store, step)
    except NotCommittedError:
        return None


def is_published(store: ObjectStore, step: int, uid: str | None) -> bool:
    """Whether version `step` is committed as the write named `uid`."""
    version = committed_version(store, step)
    return version is not None and version.uid == uid


def discard_version(store: ObjectStore, step: int, uid: str | None) -> bool:
    """Delete version `step` if it is still the write named `uid`; whether it was deleted.

    A reader calls it on a version whose files or chain do not verify: nobody can load it,
    and its writer (the trainer) notices it gone and publishes it again in full. The uid
    check spares a version published again under the same step meanwhile.
    """
    if not is_published(store, step, uid):
        return False
    delete_step(store, RunLayout.policy_dir(step))
    return True


def write_delta_file(
    store: ObjectStore, step_dir: str, name: str, delta: Delta
) -> dict[str, FileDigest]:
    """Write one delta file into `step_dir`, hashed as it streams; {name: digest}."""
    from storage.deltas import encode_delta_file

    pieces = encode_delta_file(delta)

    def fill(out: HashingWriter) -> None:
        for piece in pieces:
            out.write(piece)

    return {name: write_hashed(store, join(step_dir, name), fill)}


def load_policy_weights(store: ObjectStore, step: int) -> dict[str, torch.Tensor]:
    """Version `step`'s full weights, rebuilt from its chain and verified file by file.

    For audits, tests and exports; servers keep their own copy and apply deltas to it.
    """
    from safetensors.torch import load as load_safetensors

    from storage.deltas import apply_delta, read_delta_file

    tensors: dict[str, torch.Tensor] = {}
    for version in chain(store, step):
        step_dir = RunLayout.policy_dir(version.step)
        record = read_commit(store, step_dir)
        for name, digest in sorted(record.files.items()):
            if not name.endswith(".safetensors"):
                continue
            data = read_verified(store, join(step_dir, name), digest)
            if is_delta_file(name):
                apply_delta(tensors, read_delta_file(data, store.url(join(step_dir, name))))
            else:
                tensors.update(load_safetensors(data))
        for dropped, kept in record.meta.get("aliases", {}).items():
            tensors[dropped] = tensors[kept]
    return tensors
