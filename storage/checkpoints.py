"""Checkpoints: `<run>/checkpoints/step_NNNNNN/`, a Hugging Face model folder plus trainer state.

The folder is what `transformers.AutoModelForCausalLM.from_pretrained` and vLLM load as it is:
`config.json`, safetensors weights (one file, or shards with `model.safetensors.index.json`),
and whatever tokenizer and generation files the trainer passes through. `trainer/` holds what an
exact resume needs, as safetensors (optimizer moments, RNG states) and JSON
(`trainer/progress.json`: step, scheduler, data position); nothing is pickled.

Readers fetch a committed checkpoint into a local folder, verifying every checksum, and load
from there: inference servers and `from_pretrained` want local files anyway.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from storage.commit import (
    MARKER,
    CommitRecord,
    FileDigest,
    HashingWriter,
    begin_step,
    check_digest,
    commit_step,
    digest_bytes,
    digest_file,
    download_hashed,
    read_commit,
    write_hashed,
)
from storage.errors import CorruptObjectError, NotCommittedError, ObjectNotFoundError
from storage.layout import RunLayout
from storage.paths import clean_path, join
from storage.retention import prune_steps
from storage.store import ObjectStore
from storage.tensor_files import (
    Pieces,
    encode_tensor_files,
    index_name,
    load_tensor_files,
    prepare_tensors,
    safetensors_pieces,
    ties_word_embeddings,
)

if TYPE_CHECKING:
    import torch

CONFIG = "config.json"
WEIGHTS_STEM = "model"
#: A LoRA adapter's folder is PEFT's (`PeftModel.save_pretrained`), which vLLM's runtime LoRA
#: loading reads: its config and one weights file (no sharded index).
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_STEM = "adapter_model"
TRAINER_DIR = "trainer"
TRAINER_STATE_STEM = f"{TRAINER_DIR}/state"
PROGRESS = f"{TRAINER_DIR}/progress.json"
# Safetensors files are streamed from the tensors' own memory, so this no longer bounds memory;
# it is the largest weights file, for loaders and uploads that prefer smaller files.
DEFAULT_MAX_SHARD_BYTES = 2 * 2**30


def _is_reserved(name: str) -> bool:
    """Names the writer produces itself, which passed-through files must not replace."""
    return (
        name in (CONFIG, ADAPTER_CONFIG, MARKER)
        or name.startswith(f"{TRAINER_DIR}/")
        or (name.startswith((WEIGHTS_STEM, ADAPTER_STEM)) and ".safetensors" in name)
    )


def _json_bytes(document: Mapping[str, Any], what: str) -> bytes:
    try:
        return json.dumps(document, indent=2, sort_keys=True).encode()
    except TypeError as exc:
        raise ValueError(f"{what} must be JSON-serialisable: {exc}") from exc


def _extra_files(files: Mapping[str, bytes] | None) -> dict[str, bytes]:
    """Passed-through files, refused where they would replace one the writer produces."""
    extra = dict(files or {})
    for name in extra:
        if _is_reserved(clean_path(name, allow_empty=False)):
            raise ValueError(f"file {name!r} would replace one the checkpoint writer produces")
    return extra


def write_checkpoint(
    store: ObjectStore,
    step: int,
    *,
    weights: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    files: Mapping[str, bytes] | None = None,
    trainer_state: Mapping[str, torch.Tensor] | None = None,
    progress: Mapping[str, Any] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    meta: Mapping[str, Any] | None = None,
    parent: str = RunLayout.CHECKPOINTS,
    adapter: bool = False,
) -> CommitRecord:
    """Write checkpoint `step` below the run root `store` and commit it.

    `weights` is a full (unsharded) state dict, `config` the model's `config.to_dict()`,
    `files` extra files such as `tokenizer.json` or `generation_config.json`. The commit meta
    records `aliases`: tensors left out because they are tied to another (the output head).
    `parent` is `checkpoints` (resume checkpoints) or `policies` (policy versions: weights
    only, the same Hugging Face folder). With `adapter`, `weights` is a LoRA adapter (PEFT's
    tensor names) and `config` its `adapter_config.json`: the folder is PEFT's layout, in one
    weights file.
    """
    if adapter:
        if "peft_type" not in config:
            raise ValueError("an adapter's config must be PEFT's adapter config ('peft_type')")
        config_name, stem, max_shard_bytes = ADAPTER_CONFIG, ADAPTER_STEM, sys.maxsize
    elif "model_type" not in config:
        raise ValueError("config must be a Hugging Face config dict with 'model_type'")
    else:
        config_name, stem = CONFIG, WEIGHTS_STEM
    extra = _extra_files(files)
    tensors, aliases = prepare_tensors(
        weights, tie_word_embeddings=not adapter and ties_word_embeddings(config)
    )
    step_dir = join(parent, RunLayout.step_name(step))
    begin_step(store, step_dir)
    digests: dict[str, FileDigest] = {}

    def put(name: str, data: bytes) -> None:
        digests[name] = digest_bytes(data)
        store.write_bytes(join(step_dir, name), data)

    def stream(name: str, pieces: Pieces) -> None:
        """Write a file piece by piece straight into the store, hashing as the bytes pass."""
        if len(pieces) == 1:
            put(name, bytes(pieces[0]))
            return

        def fill(out: HashingWriter) -> None:
            for piece in pieces:
                out.write(piece)

        digests[name] = write_hashed(store, join(step_dir, name), fill)

    for name, data in extra.items():
        put(name, data)
    put(config_name, _json_bytes(config, "config"))
    for name, pieces in encode_tensor_files(tensors, stem, max_shard_bytes=max_shard_bytes):
        stream(name, pieces)
    if trainer_state:
        state, _ = prepare_tensors(trainer_state, tie_word_embeddings=False)
        for name, pieces in encode_tensor_files(
            state, TRAINER_STATE_STEM, max_shard_bytes=max_shard_bytes
        ):
            stream(name, pieces)
    if progress is not None:
        put(PROGRESS, _json_bytes(progress, "progress"))
    return commit_step(
        store, step_dir, digests, step=step, meta={**(meta or {}), "aliases": aliases}
    )


def write_tensor_file(
    store: ObjectStore, step_dir: str, name: str, tensors: Mapping[str, torch.Tensor]
) -> dict[str, FileDigest]:
    """One safetensors file of a checkpoint several writers fill (`commit_sharded_checkpoint`):
    weights or trainer state; {name: digest}."""
    tensors, _ = prepare_tensors(tensors, tie_word_embeddings=False)
    pieces = safetensors_pieces(tensors, {"format": "pt"})

    def fill(out: HashingWriter) -> None:
        for piece in pieces:
            out.write(piece)

    return {name: write_hashed(store, join(step_dir, name), fill)}


def commit_sharded_checkpoint(
    store: ObjectStore,
    step: int,
    *,
    shards: Mapping[str, FileDigest],
    weight_map: Mapping[str, str],
    total_size: int,
    config: Mapping[str, Any],
    files: Mapping[str, bytes] | None = None,
    meta: Mapping[str, Any] | None = None,
    parent: str = RunLayout.CHECKPOINTS,
    trainer_map: Mapping[str, str] | None = None,
    trainer_size: int = 0,
    progress: Mapping[str, Any] | None = None,
) -> CommitRecord:
    """Add `config.json`, the index and `files` to weights files others wrote, and commit.

    `weight_map` maps each tensor to its file, as `model.safetensors.index.json` does, so the
    folder is the Hugging Face sharded layout that `transformers` and vLLM load as it is.
    A resume checkpoint's trainer-state files get the same kind of index (`trainer_map`, file
    names relative to `trainer/`), and its `progress` is written here.
    """
    if "model_type" not in config:
        raise ValueError("config must be a Hugging Face config dict with 'model_type'")
    state_files = {join(TRAINER_DIR, name) for name in (trainer_map or {}).values()}
    missing = sorted({*weight_map.values(), *state_files} - set(shards))
    if missing:
        raise ValueError(f"the index names files nobody wrote: {missing}")
    step_dir = join(parent, RunLayout.step_name(step))
    digests = dict(shards)
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(weight_map)}
    extra = {
        **_extra_files(files),
        CONFIG: _json_bytes(config, "config"),
        index_name(WEIGHTS_STEM): _json_bytes(index, "index"),
    }
    if trainer_map:
        state_index = {"metadata": {"total_size": trainer_size}, "weight_map": dict(trainer_map)}
        extra[index_name(TRAINER_STATE_STEM)] = _json_bytes(state_index, "index")
    if progress is not None:
        extra[PROGRESS] = _json_bytes(progress, "progress")
    for name, data in extra.items():
        digests[name] = digest_bytes(data)
        store.write_bytes(join(step_dir, name), data)
    return commit_step(store, step_dir, digests, step=step, meta={**(meta or {}), "aliases": {}})


def _is_trainer_file(name: str) -> bool:
    return name.startswith(f"{TRAINER_DIR}/")


def _local_record(local_dir: Path) -> CommitRecord | None:
    marker = local_dir / MARKER
    if not marker.is_file():
        return None
    return CommitRecord.from_json(marker.as_uri(), marker.read_bytes())


def verify_local_checkpoint(folder: Path) -> CommitRecord:
    """Check a committed step folder on local disk against its marker, file by file, before it
    is served where it lies (`file://` runs are not fetched, so nothing else hashes them): a
    changed or missing file is a `CorruptObjectError` naming it. Trainer state is skipped
    (servers never read it)."""
    record = _local_record(folder)
    if record is None:
        raise NotCommittedError(folder.as_uri(), f"no {MARKER}")
    for name, expected in sorted(record.files.items()):
        if _is_trainer_file(name):
            continue
        path = folder / name
        if not path.is_file():
            raise CorruptObjectError(path.as_uri(), f"listed in {MARKER} but missing")
        check_digest(path.as_uri(), digest_file(path, expected.algorithm), expected)
    return record


def _fetch_verified(
    store: ObjectStore, step_dir: str, name: str, expected: FileDigest, folder: Path
) -> None:
    """Download one file into `folder` and prove it matches the marker before it appears.

    The file is hashed as it is copied, so it is not read a second time to verify it.
    """
    target = folder / name
    partial = target.with_name(f"{target.name}.partial-{uuid.uuid4().hex}")
    remote = join(step_dir, name)
    try:
        actual = download_hashed(store, remote, partial, expected.algorithm)
    except ObjectNotFoundError:
        # The same error a reader of shards gets: the commit is broken, not merely absent.
        raise CorruptObjectError(store.url(remote), f"listed in {MARKER} but missing") from None
    try:
        check_digest(store.url(remote), actual, expected)
    except BaseException:
        partial.unlink()
        raise
    os.replace(partial, target)


def fetch_checkpoint(
    store: ObjectStore,
    step: int,
    local_dir: str | os.PathLike[str],
    *,
    trainer_state: bool = False,
    parent: str = RunLayout.CHECKPOINTS,
) -> Path:
    """Download committed checkpoint `step` into `local_dir`, verified; returns the folder.

    A folder already holding this exact commit (its `_COMMITTED` equals the remote one) is
    reused, fetching only files it lacks. Otherwise the checkpoint is assembled in a sibling
    folder and swapped in whole, so `local_dir` never holds a mix of two checkpoints. Trainer
    state (`trainer/`) is fetched only when `trainer_state` is true; inference needs none.
    """
    folder = Path(local_dir).absolute()
    step_dir = join(parent, RunLayout.step_name(step))
    record = read_commit(store, step_dir)
    wanted = {
        name: digest
        for name, digest in record.files.items()
        if trainer_state or not _is_trainer_file(name)
    }
    existing = _local_record(folder) if folder.is_dir() else None
    if existing is not None and existing == record:
        for name, digest in sorted(wanted.items()):
            present = folder / name
            if not (present.is_file() and present.stat().st_size == digest.size):
                present.parent.mkdir(parents=True, exist_ok=True)
                _fetch_verified(store, step_dir, name, digest, folder)
        return folder
    if folder.exists() and existing is None and any(folder.iterdir()):
        raise ValueError(f"{folder} exists and is not a fetched checkpoint; pass a new folder")
    _assemble(store, step_dir, record, wanted, folder)
    return folder


def copy_local_checkpoint(source: Path, target: Path) -> CommitRecord:
    """Copy committed local step folder `source` (trainer state left behind) to `target`,
    every file verified against `source`'s marker as it is copied; returns that marker.

    For a reader that must not see its folder change under it: a resumed trainer deletes its
    policy versions past its checkpoint and publishes their step numbers again into the same
    folders, while a server may still read the old ones (vLLM reloads an adapter from its
    folder whenever it brings it back into its cache). A copy taken while `source` was being
    rewritten fails with `CorruptObjectError` and leaves `target` as it was.
    """
    record = _local_record(source)
    if record is None:
        raise NotCommittedError(source.as_uri(), f"no {MARKER}")
    wanted = {n: d for n, d in record.files.items() if not _is_trainer_file(n)}
    _assemble(ObjectStore(source.absolute().as_uri()), "", record, wanted, target.absolute())
    return record


def _assemble(
    store: ObjectStore,
    step_dir: str,
    record: CommitRecord,
    wanted: Mapping[str, FileDigest],
    folder: Path,
) -> None:
    """Copy `wanted` of committed `step_dir` into a sibling of `folder`, each file verified
    as it is copied, and swap it in whole: `folder` never holds a mix of two steps."""
    staging = folder.with_name(f"{folder.name}.partial-{uuid.uuid4().hex}")
    try:
        for name, digest in sorted(wanted.items()):
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            _fetch_verified(store, step_dir, name, digest, staging)
        (staging / MARKER).write_bytes(record.to_json())
        _swap_in(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _swap_in(staging: Path, folder: Path) -> None:
    """Replace `folder` with `staging`, deleting the old contents only once the new are in place."""
    if not folder.exists():
        os.replace(staging, folder)
        return
    retired = folder.with_name(f"{folder.name}.old-{uuid.uuid4().hex}")
    os.replace(folder, retired)
    os.replace(staging, folder)
    shutil.rmtree(retired, ignore_errors=True)


def is_adapter(folder: Path) -> bool:
    """Whether a local checkpoint folder holds a LoRA adapter rather than a whole model."""
    return (folder / ADAPTER_CONFIG).is_file()


def base_model_of(folder: Path) -> str | None:
    """The base model a local adapter folder names (PEFT's `base_model_name_or_path`)."""
    base = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    return base if isinstance(base, str) and base else None


def load_checkpoint_weights(local_dir: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The full state dict of a fetched checkpoint (or any Hugging Face safetensors folder),
    or an adapter's tensors (PEFT's names) for an adapter folder.

    Tied tensors left out on write come back as the very tensor they alias, as in the model.
    """
    folder = Path(local_dir)
    tensors = load_tensor_files(folder, ADAPTER_STEM if is_adapter(folder) else WEIGHTS_STEM)
    record = _local_record(folder)
    for dropped, kept in (record.meta.get("aliases", {}) if record else {}).items():
        tensors[dropped] = tensors[kept]
    return tensors


@dataclass(frozen=True)
class TrainerState:
    """What `write_checkpoint` stored for an exact resume."""

    tensors: dict[str, torch.Tensor]
    progress: dict[str, Any]


def load_trainer_state(local_dir: str | os.PathLike[str]) -> TrainerState:
    """Trainer tensors and progress of a checkpoint fetched with `trainer_state=True`."""
    folder = Path(local_dir)
    if not (folder / TRAINER_DIR).is_dir():
        raise FileNotFoundError(
            f"{folder / TRAINER_DIR} is missing: fetch the checkpoint with trainer_state=True"
        )
    state_files = (folder / f"{TRAINER_STATE_STEM}.safetensors").is_file() or (
        folder / f"{TRAINER_STATE_STEM}.safetensors.index.json"
    ).is_file()
    tensors = load_tensor_files(folder, TRAINER_STATE_STEM) if state_files else {}
    progress_path = folder / PROGRESS
    progress = json.loads(progress_path.read_text()) if progress_path.is_file() else {}
    return TrainerState(tensors=tensors, progress=progress)


def log_commit(store: ObjectStore, step: int, parent: str = RunLayout.CHECKPOINTS) -> None:
    """Record that checkpoint `step` is committed (after its marker, before any retention)."""
    _log_step(store, RunLayout.commit_log_entry(parent, step), step, parent)


def logged_commits(store: ObjectStore, parent: str = RunLayout.CHECKPOINTS) -> list[int]:
    """Every step `log_commit` recorded below `parent`, pruned since or not, in order."""
    return _logged_steps(store, RunLayout.commit_log_dir(parent))


def log_announced(store: ObjectStore, step: int, parent: str = RunLayout.CHECKPOINTS) -> None:
    """Record that watchers were told checkpoint `step` of `parent` is committed."""
    _log_step(store, RunLayout.announced_entry(parent, step), step, parent)


def announced_steps(store: ObjectStore, parent: str = RunLayout.CHECKPOINTS) -> list[int]:
    """Every step `log_announced` recorded below `parent`, in order."""
    return _logged_steps(store, RunLayout.announced_dir(parent))


def _log_step(store: ObjectStore, path: str, step: int, parent: str) -> None:
    entry = {"step": step, "uri": store.url(join(parent, RunLayout.step_name(step)))}
    store.write_bytes(path, _json_bytes(entry, "log entry"))


def _logged_steps(store: ObjectStore, folder: str) -> list[int]:
    steps = (RunLayout.parse_step(name.removesuffix(".json")) for name in store.list(folder))
    return sorted(step for step in steps if step is not None)


def require_committed(store: ObjectStore, step: int, parent: str = RunLayout.CHECKPOINTS) -> None:
    """`NotCommittedError` unless checkpoint `step` is there to read, saying whether retention
    deleted it: found before an evaluation starts its servers."""
    step_dir = join(parent, RunLayout.step_name(step))
    if store.exists(join(step_dir, MARKER)):
        return
    if step in logged_commits(store, parent):
        reason = "was committed, then deleted by retention (raise checkpoint.keep_last to keep it)"
    else:
        reason = "was never committed"
    raise NotCommittedError(store.url(step_dir), reason)


def apply_retention(
    store: ObjectStore,
    *,
    keep_last: int | None,
    keep_every: int | None = None,
    protect: Iterable[int] = (),
) -> list[int]:
    """Delete old committed resume checkpoints of the run root `store` (policy versions:
    `storage.policies.prune_policies`, which keeps their chains).

    Keeps the newest `keep_last`, every multiple of `keep_every` and the `protect`ed steps
    (e.g. one an evaluation is reading). `keep_last=None` keeps everything. Returns the deleted
    steps.
    """
    return prune_steps(
        store, RunLayout.CHECKPOINTS, keep_last=keep_last, keep_every=keep_every, protect=protect
    )
