"""One step written by several ranks: each rank's part, gathered by rank 0 before it commits.

A policy version or resume checkpoint is written by every trainer rank that owns some of it:
each rank writes its own files, then a `_PART-RRRRR.json` listing their digests; rank 0 waits
for every part, then commits them all in one marker (`storage.commit`), so readers see the
whole step or nothing. Parts carry the uid of the step being written, so a part left by a dead
writer of the same step number is never taken for the live one's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from typing import Any, cast

from storage.commit import FileDigest
from storage.errors import ObjectNotFoundError, StepTimeoutError
from storage.paths import join
from storage.store import ObjectStore

#: How long rank 0 waits for the other ranks' parts of a step before it fails the stage.
PART_TIMEOUT_S = 600.0


def part_marker(rank: int) -> str:
    return f"_PART-{rank:05d}.json"


def write_part(
    store: ObjectStore, step_dir: str, rank: int, files: Mapping[str, FileDigest], *, uid: str
) -> None:
    """Record the files rank `rank` wrote into `step_dir` for version `uid`, after them."""
    document = {"uid": uid, "files": {name: digest.to_json() for name, digest in files.items()}}
    store.write_bytes(join(step_dir, part_marker(rank)), json.dumps(document).encode())


def wait_for_parts(
    store: ObjectStore,
    step_dir: str,
    ranks: Iterable[int],
    *,
    uid: str,
    timeout_s: float = PART_TIMEOUT_S,
) -> dict[str, FileDigest]:
    """Every file the other `ranks` wrote into `step_dir` for version `uid`.

    A part of another uid is a dead writer's (the step number was published before a resume)
    and is waited past until this version's replaces it.
    """
    files: dict[str, FileDigest] = {}
    deadline = time.monotonic() + timeout_s
    for rank in ranks:
        while (document := _read_part(store, join(step_dir, part_marker(rank)))) is None or (
            document.get("uid") != uid
        ):
            if time.monotonic() > deadline:
                raise StepTimeoutError(
                    store.url(step_dir), f"rank {rank} did not write its part in {timeout_s:g}s"
                )
            time.sleep(0.02)
        files.update(
            {name: FileDigest.from_json(entry) for name, entry in document["files"].items()}
        )
    return files


def _read_part(store: ObjectStore, path: str) -> dict[str, Any] | None:
    try:
        return cast(dict[str, Any], json.loads(store.read_bytes(path)))
    except ObjectNotFoundError:
        return None


def gather_parts(
    store: ObjectStore,
    step_dir: str,
    mine: Mapping[str, FileDigest],
    *,
    rank: int,
    world: int,
    uid: str,
) -> dict[str, FileDigest] | None:
    """Rank 0: its files and every other rank's, once all are written (then it commits);
    other ranks: None, after recording their files as their part of the step written as
    `uid`."""
    if rank != 0:
        write_part(store, step_dir, rank, mine, uid=uid)
        return None
    return {**mine, **wait_for_parts(store, step_dir, range(1, world), uid=uid)}
