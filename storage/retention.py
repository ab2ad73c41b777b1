"""Which committed steps to keep, and deleting the rest without ever exposing half a step.

Steps are deleted marker first (see `commit.delete_step`): a reader either finds a complete
committed step or no step at all. Uncommitted folders are left alone, since a writer may be
filling one right now.
"""

from __future__ import annotations

from collections.abc import Iterable

from storage.commit import committed_steps, delete_step
from storage.layout import RunLayout
from storage.paths import join
from storage.store import ObjectStore


def steps_to_delete(
    steps: Iterable[int],
    *,
    keep_last: int | None,
    keep_every: int | None = None,
    protect: Iterable[int] = (),
) -> list[int]:
    """Steps outside the newest `keep_last`, not multiples of `keep_every`, not protected.

    `keep_last=None` turns retention off. The newest step always survives, since a resume
    needs it.
    """
    if keep_last is None:
        return []
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the newest step is needed), got {keep_last}")
    if keep_every is not None and keep_every < 1:
        raise ValueError(f"keep_every must be >= 1, got {keep_every}")
    ordered = sorted(set(steps))
    kept = set(ordered[-keep_last:]) | set(protect)
    if keep_every is not None:
        kept |= {step for step in ordered if step % keep_every == 0}
    return [step for step in ordered if step not in kept]


def prune_steps(
    store: ObjectStore,
    parent: str,
    *,
    keep_last: int | None,
    keep_every: int | None = None,
    protect: Iterable[int] = (),
) -> list[int]:
    """Delete committed steps below `parent` per `steps_to_delete`; returns the deleted steps."""
    doomed = steps_to_delete(
        committed_steps(store, parent), keep_last=keep_last, keep_every=keep_every, protect=protect
    )
    for step in doomed:
        delete_step(store, join(parent, RunLayout.step_name(step)))
    return doomed
