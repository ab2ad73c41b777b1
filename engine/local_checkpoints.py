"""Committed checkpoints and policy versions as local folders: where both pools read them.

The trainer starts RL from the SFT checkpoint and the servers load policy versions; neither
pool imports the other (a layering contract), so what they share about reading a committed
step lives here, above `storage`. vLLM workers load weights from a local path. A checkpoint
named by a remote URI (`s3://...`, `gs://...`, `memory://...`) is fetched with the storage
layer's `fetch_checkpoint` (every file verified against the step's `_COMMITTED` marker, trainer
state left behind, the folder swapped in whole) into a cache folder named by the URI's hash; a
`file://` URI is used where it lies, once every file has been checked against the marker; a
bare path (a model folder) as it is.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from engine.config.run import StorageConfig
from engine.run import store_at
from storage.backends import split_uri
from storage.checkpoints import fetch_checkpoint, verify_local_checkpoint
from storage.commit import MARKER
from storage.errors import CorruptObjectError, NotCommittedError
from storage.layout import RunLayout
from storage.policies import chain
from storage.store import ObjectStore


class CheckpointError(ValueError):
    """A checkpoint that cannot be served: missing, uncommitted, corrupt, or for another model."""


class DamagedCheckpointError(CheckpointError):
    """A committed step, or a step of a policy version's chain, that does not verify: a file
    altered or missing since its commit, a marker gone, a delta whose base was deleted.
    Reading it again cannot help; the policy version concerned must be written again."""


def checkpoint_step(location: str) -> int | None:
    """The step in a `.../step_000042` location, or None."""
    return RunLayout.parse_step(location.rstrip("/").rsplit("/", 1)[-1])


#: Where servable folders live below a run root: resume checkpoints and policy versions.
_PARENTS = (RunLayout.CHECKPOINTS, RunLayout.POLICIES)


def _split(location: str) -> tuple[str, str, int] | None:
    """(run root, parent, step) of `<run root>/<parent>/step_NNNNNN`, or None."""
    for parent in _PARENTS:
        root, _, step_name = location.rstrip("/").rpartition(f"/{parent}/")
        step = RunLayout.parse_step(step_name)
        if root and step is not None:
            return root, parent, step
    return None


def version_chain(
    location: str, held_uid: str | None, storage: StorageConfig | None = None
) -> list[str]:
    """The locations to load, in order, to serve `location`, holding version `held_uid`
    (read with the run's `storage` settings).

    A policy version's chain (`storage.policies.chain`): a full version and the deltas after
    it, or only the deltas after the held one (empty when `location` is the held version).
    Anything else (a resume checkpoint, a bare model folder) is loaded on its own.
    """
    split = _split(location)
    if split is None or split[1] != RunLayout.POLICIES:
        return [location]
    root = split[0]
    try:
        versions = chain(_store(root, storage), split[2], held_uid=held_uid)
    except NotCommittedError as exc:
        raise DamagedCheckpointError(f"policy version {location} is not committed") from exc
    except ValueError as exc:
        raise DamagedCheckpointError(f"cannot rebuild {location}: {exc}") from exc
    return [f"{root}/{RunLayout.policy_dir(version.step)}" for version in versions]


def fetched_dir(cache_dir: Path) -> Path:
    """Where remote checkpoints are fetched to, one folder per URI."""
    return cache_dir / "checkpoints"


def adapter_copies_dir(cache_dir: Path) -> Path:
    """Where the servers' private copies of adapters are, one folder per lineage
    (`engine.inference.adapters`)."""
    return cache_dir / "adapters"


def forget_fetched(cache_dir: Path, folders: set[Path]) -> None:
    """Delete the fetched copies among `folders` (not in-place `file://` folders) once no
    server needs them, so a long run on remote storage does not fill the cache with every
    version it loaded."""
    fetched = fetched_dir(cache_dir).resolve()
    for folder in folders:
        if folder.resolve().parent == fetched:
            shutil.rmtree(folder, ignore_errors=True)


def _store(root: str, storage: StorageConfig | None) -> ObjectStore:
    return store_at(root, storage or StorageConfig(uri=root))


def _fetch(uri: str, cache_dir: Path, storage: StorageConfig | None) -> Path:
    """Download the committed checkpoint at `uri` into the cache (reused when already there)."""
    split = _split(uri)
    if split is None:
        raise CheckpointError(
            f"remote checkpoint {uri} must be <run root>/{{{','.join(_PARENTS)}}}/step_NNNNNN"
        )
    root, parent, step = split
    target = fetched_dir(cache_dir) / hashlib.sha256(uri.encode()).hexdigest()[:16]
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        return fetch_checkpoint(_store(root, storage), step, target, parent=parent)
    except (CorruptObjectError, NotCommittedError) as exc:
        raise DamagedCheckpointError(f"checkpoint {uri} is damaged: {exc}") from exc


def local_checkpoint(
    checkpoint: str | os.PathLike[str], cache_dir: Path, storage: StorageConfig | None = None
) -> Path:
    """A local folder holding `checkpoint` (a path or a storage URI of a committed step,
    fetched with the run's `storage` settings)."""
    location = os.fspath(checkpoint)
    protocol, path = split_uri(location)
    if protocol != "file":
        return _fetch(location, cache_dir, storage)
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {location} does not exist")
    if location.startswith("file://"):
        if not (folder / MARKER).is_file():
            raise DamagedCheckpointError(f"checkpoint {location} is not committed (no {MARKER})")
        try:
            verify_local_checkpoint(folder)
        except CorruptObjectError as exc:
            raise DamagedCheckpointError(f"checkpoint {location} is damaged: {exc}") from None
    return folder
