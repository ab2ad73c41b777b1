"""Policy versions: what a server loads, published after every RL step, off the training path.

A resume checkpoint (fp32 masters, AdamW moments, RNG) is ~12 bytes a parameter and written
every `checkpoint.interval` steps; a server needs only the weights in its serving dtype (2 bytes
a parameter for bf16), and from one step to the next only a few percent of those change. After
the optimizer step the trainer *snapshots* the policy: every rank casts the rows it owns to the
serving dtype on the device, end to end in one stream (`OwnedStream`), and compares it bit for
bit with the previous version's stream. Usually the version is published as a *delta*
(`storage.deltas`: the changed entries, encoded on the device, only they copied to pinned host
memory), each rank writing its own file; every `policy.full_every` versions, after a (re)start,
or when a delta would not be smaller once compressed, it is *full*: the usual Hugging Face
folder, every parameter gathered on the device one at a time and copied to the host of the one
rank that writes it (`assign_owners`: each rank about 1/world of the bytes, a sharded folder
with an index when there are several). Background threads compress, hash, write and commit
`policies/step_N` and apply retention while the next step trains. One publication is in
flight at a time: the next snapshot first waits for it, and that wait is the step's
`publish_wait_seconds`.

Whether a delta is smaller is decided before it is compressed (the snapshot must choose), at
the compression its predecessor reached. Raw, a changed bf16 entry costs 6 bytes against 2 for
every entry of a full version; compressed, ~0.6. Judged raw, an RL step that changes a third of
the entries (the 76M GPU recipe at lr 1e-4: 31-39 %) wrote 58 % of its versions full, and the
pool's reloads that carried one loaded in 0.24 s against 0.18 s for deltas alone
(docs/benchmarks.md). Until a delta has been measured, one is written to measure.

The cast is the one the server would make (`Tensor.to`, round to nearest even), so the served
weights are bit-identical to the trainer's, which `inference.verify_reloads` checks.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch
from torch.optim import Optimizer

from engine.config.trainer import PolicyConfig
from engine.trainer.background import BackgroundWrite
from engine.trainer.checkpoint_state import model_tensors, state_file
from engine.trainer.distributed import DistInfo, agree_sums, from_main, shared_uid
from engine.trainer.host_copies import Fence
from engine.trainer.lora import adapter_config, published
from engine.trainer.model import PolicyModel
from engine.trainer.owners import assign_owners
from engine.trainer.snapshot import OwnedStream, Staging, serving_dtype, snapshot_weights
from storage.checkpoints import (
    WEIGHTS_STEM,
    commit_sharded_checkpoint,
    write_checkpoint,
    write_tensor_file,
)
from storage.commit import FileDigest, begin_step, commit_step, committed_steps
from storage.deltas import (
    changed_entries,
    compress_entries,
    pack_entries,
)
from storage.layout import RunLayout, delta_file_name
from storage.parts import gather_parts
from storage.policies import (
    DELTA,
    FULL,
    VersionInfo,
    committed_version,
    forget_after,
    is_published,
    prune_policies,
    write_delta_file,
)
from storage.store import ObjectStore

log = logging.getLogger("primeflow.trainer")


class PolicyPublisher:
    """Publishes the policy versions of one RL run, every rank its part, in the background.

    `lineage` is the resume checkpoint's step the trainer started from (0: a fresh start),
    recorded in every version's commit meta so an audit can tell a version written before a
    resume from one written after it; `lineage_id`, drawn when the trainer starts, tells two
    trainers apart that resumed from the same checkpoint, and servers stamp every sample with
    it (the shards' `policy_lineage`). Every version also gets a random `uid`, and a delta
    names its base's (`storage.policies`), so no reader applies it to another lineage.
    """

    #: Whether versions may be deltas (and full ones sharded over the ranks).
    publishes_deltas: ClassVar[bool] = True

    def __init__(
        self,
        store: ObjectStore,
        policy: PolicyModel,
        optimizer: Optimizer,
        dist_info: DistInfo,
        *,
        config: PolicyConfig,
        files: Mapping[str, bytes],
        lineage: int,
    ) -> None:
        self.store = store
        self.policy = policy
        self.optimizer = optimizer
        self.dist_info = dist_info
        self.config = config
        self.files = dict(files)
        self.lineage = lineage
        self.lineage_id = shared_uid(dist_info)
        self.dtype = serving_dtype(policy.config)
        self._writes = BackgroundWrite("a policy version")
        # Laid out once: naming the parameters costs more than the snapshot itself.
        self._params = model_tensors(policy)
        self._sizes = {name: tensor.numel() for name, tensor in self._params}
        #: (step, uid) of the newest version this trainer published or started from: what
        #: its weights are between two steps, and the base of its next delta.
        self.newest: tuple[int, str | None] | None = None
        #: The owned rows of the newest version, in the serving dtype (None: the next
        #: version is full).
        self._previous: torch.Tensor | None = None
        if not self.publishes_deltas:
            return
        # What deltas and sharded full versions need: the owned rows in the serving dtype on
        # the device (2 bytes a parameter for bf16), pinned staging, the version before.
        self._stream = OwnedStream(self._params, self.dtype, dist_info)
        self._staging = Staging(dist_info.device.type == "cuda")
        self._owners = assign_owners(self._sizes, dist_info.world_size)
        self._since_full = 0
        #: This rank's newest delta: its compressed and raw bytes (0, 0 before the first).
        self._delta_bytes = (0, 0)

    def publish(self, step: int) -> dict[str, float]:
        """Snapshot the policy as version `step` and write it in the background (collective).

        Returns the seconds this step stalled (waiting for the previous publication, taking the
        snapshot), how long the previous version took to write and commit behind training
        (on-policy the pool waits for it), whether the version is full and the fraction of
        entries that changed. A failed earlier publication is raised here.
        """
        started = time.perf_counter()
        self.flush()
        waited = time.perf_counter() - started
        current = self._stream.cast()
        entries, local_count = None, 0
        if self._previous is not None:
            positions, zigzag = changed_entries(self._previous, current)
            entries = pack_entries(positions, zigzag, current.element_size())
            local_count = positions.numel()
            del positions, zigzag
        itemsize = current.element_size()
        uid = shared_uid(self.dist_info)
        # Summed over the ranks: a full version unless every rank's delta is encodable and
        # all of them together, compressed as the last delta was, are smaller than the weights.
        unencodable, raw, full, changed, total, last_compressed, last_raw = agree_sums(
            [
                int(entries is None),
                0 if entries is None else entries.numel(),
                current.numel() * itemsize,
                current.numel() if entries is None else local_count,
                current.numel(),
                *self._delta_bytes,
            ],
            self.dist_info,
        )
        smaller = not last_raw or raw * last_compressed < full * last_raw
        as_delta = not unencodable and self._delta_due() and smaller
        if as_delta:
            assert entries is not None and self.newest is not None
            packed = self._staging.copy(entries)
            job = functools.partial(self._write_delta, step, uid, self.newest, packed, local_count)
            self._since_full += 1
        else:
            job = self._full_job(step, uid)
            self._since_full = 0
        self._previous, self.newest = current, (step, uid)
        self._writes.start(f"publish-{step}", job)
        return {
            "publish_wait_seconds": waited,
            "publish_snapshot_seconds": time.perf_counter() - started - waited,
            "publish_write_seconds": self._writes.last_seconds,  # the previous version's
            "policy_full": float(not as_delta),
            "policy_changed_fraction": changed / max(total, 1),
        }

    def _delta_due(self) -> bool:
        """The same answer on every rank: they share the schedule."""
        return self._since_full + 1 < self.config.full_every

    def _full_job(self, step: int, uid: str) -> functools.partial[None]:
        weights, fence = snapshot_weights(self._params, self.dtype, self.dist_info, self._owners)
        fence.guard(self.optimizer)
        write = self._write_full if self.dist_info.world_size == 1 else self._write_full_shard
        return functools.partial(write, step, uid, weights, fence)

    def flush(self) -> None:
        """Wait for the publication in flight; raise its error, if it failed."""
        self._writes.wait()

    def close(self) -> None:
        """Wait for the publication in flight, if any, without raising."""
        self._writes.close()

    def _meta(self, uid: str) -> dict[str, Any]:
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "lineage": self.lineage,
            "lineage_id": self.lineage_id,
            "uid": uid,
            "full_every": self.config.full_every,
        }

    def _write_full(
        self, step: int, uid: str, weights: dict[str, torch.Tensor], fence: Fence
    ) -> None:
        fence.wait()
        write_checkpoint(
            self.store,
            step,
            parent=RunLayout.POLICIES,
            meta={**self._meta(uid), "kind": FULL},
            **self._folder(weights),
        )
        self._prune()

    def _folder(self, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
        """What a full version's folder holds: a Hugging Face model folder."""
        return {"weights": weights, "config": self.policy.config.to_dict(), "files": self.files}

    def _write_full_shard(
        self, step: int, uid: str, weights: dict[str, torch.Tensor], fence: Fence
    ) -> None:
        """Several ranks: each writes the whole tensors it owns; rank 0 the index and marker."""
        fence.wait()
        step_dir = RunLayout.policy_dir(step)
        rank, world = self.dist_info.rank, self.dist_info.world_size
        mine = {}
        if weights:
            name = state_file(WEIGHTS_STEM, rank, world)
            mine = write_tensor_file(self.store, step_dir, name, weights)
        files = self._all_parts(step_dir, uid, mine)
        if files is None:
            return
        commit_sharded_checkpoint(
            self.store,
            step,
            shards=files,
            weight_map={n: state_file(WEIGHTS_STEM, r, world) for n, r in self._owners.items()},
            total_size=sum(self._sizes.values()) * self.dtype.itemsize,
            config=self.policy.config.to_dict(),
            files=self.files,
            meta={**self._meta(uid), "kind": FULL},
            parent=RunLayout.POLICIES,
        )
        self._prune()

    def _write_delta(
        self,
        step: int,
        uid: str,
        base: tuple[int, str | None],
        packed: np.ndarray,
        count: int,
    ) -> None:
        step_dir = RunLayout.policy_dir(step)
        rank, world = self.dist_info.rank, self.dist_info.world_size
        if world == 1:
            begin_step(self.store, step_dir)
        delta = compress_entries(self._stream.parts, packed, count)
        self._delta_bytes = (delta.compressed_bytes, packed.nbytes)
        mine = write_delta_file(self.store, step_dir, delta_file_name(rank, world), delta)
        files = self._all_parts(step_dir, uid, mine)
        if files is None:
            return
        meta = {**self._meta(uid), "kind": DELTA, "base": base[0], "base_uid": base[1]}
        commit_step(self.store, step_dir, files, step=step, meta=meta)
        self._prune()

    def _all_parts(
        self, step_dir: str, uid: str, mine: dict[str, FileDigest]
    ) -> dict[str, FileDigest] | None:
        rank, world = self.dist_info.rank, self.dist_info.world_size
        return gather_parts(self.store, step_dir, mine, rank=rank, world=world, uid=uid)

    def _prune(self) -> None:
        prune_policies(
            self.store, keep_last=self.config.keep_last, keep_every=self.config.keep_every
        )

    def start(self, step: int) -> list[int]:
        """Begin this trainer's lineage at version `step`, the checkpoint it resumed from (0:
        the starting weights); collective. Returns the newer versions it deleted.

        Those came from a trainer that died before checkpointing them: a server must never
        load them once this one trains (the RL stage clears them before its orchestrator
        starts too, `engine.stages.run_rl`; a trainer run alone relies on this). Version
        `step` is published when it is not committed (retention, or a reader that found it
        damaged, removed it), so the pool can always go back to where this lineage begins;
        otherwise it is adopted as the newest version, and `repair` puts it back if a reader
        discards it. Rank 0 reads and deletes; the others learn the outcome from it, so none
        lists the folder while it changes.
        """
        newer: list[int] = []
        kept: VersionInfo | None = None
        if self.dist_info.is_main:
            newer = forget_after(self.store, step)
            if step in committed_steps(self.store, RunLayout.POLICIES):
                kept = committed_version(self.store, step)
        newer, kept = from_main((newer, kept), self.dist_info)
        if kept is None:
            self.publish(step)
        else:
            self.newest = (step, kept.uid)
        return newer

    def repair(self) -> bool:
        """Publish the newest version again, in full, if a reader discarded it (collective;
        rank 0 looks); whether it did.

        A server that cannot rebuild a version (a file altered after its commit, a delta
        whose base was deleted) discards it (`storage.policies.discard_version`) and serves an
        older one meanwhile; the next delta would name the discarded version as its base, and
        an on-policy orchestrator would wait for it forever. Only the trainer holds those
        weights: call this between steps, when they are still the newest version's.
        """
        gone = False
        if self.dist_info.is_main and self.newest is not None:
            self.flush()  # a version still being written is not gone
            gone = not is_published(self.store, *self.newest)
        if not agree_sums([int(gone)], self.dist_info)[0]:
            return False
        assert self.newest is not None
        step = self.newest[0]
        log.warning(
            "policy version %d was discarded by a reader that could not rebuild it: "
            "publishing it again in full",
            step,
        )
        self._previous = None
        self.publish(step)
        return True


class AdapterPublisher(PolicyPublisher):
    """A LoRA run's policy versions: the whole adapter every step, in PEFT's layout and the
    serving dtype, which a server loads beside the base it already serves.

    An adapter is ~1 % of the model's bytes and nearly all of its entries change every step,
    so there are no deltas; it is gathered to rank 0, which writes it in the background.
    Version 0 (B = 0) is the base model itself.
    """

    publishes_deltas = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        lora = self.policy.lora
        assert lora is not None, "AdapterPublisher needs a policy built with trainer.lora"
        self._adapter = adapter_config(lora, self.policy.adapter_base)

    def publish(self, step: int) -> dict[str, float]:
        """Snapshot the adapter as version `step` and write it in the background (collective)."""
        started = time.perf_counter()
        self.flush()
        waited = time.perf_counter() - started
        uid = shared_uid(self.dist_info)
        weights, fence = snapshot_weights(self._params, self.dtype, self.dist_info)
        fence.guard(self.optimizer)
        if self.dist_info.is_main:
            self._writes.start(
                f"publish-{step}", functools.partial(self._write_full, step, uid, weights, fence)
            )
        self.newest = (step, uid)
        return {
            "publish_wait_seconds": waited,
            "publish_snapshot_seconds": time.perf_counter() - started - waited,
            "publish_write_seconds": self._writes.last_seconds,  # the previous version's
            "policy_full": 1.0,
            "policy_bytes": float(sum(self._sizes.values()) * self.dtype.itemsize),
        }

    def _meta(self, uid: str) -> dict[str, Any]:
        return {**super()._meta(uid), "adapter": True}

    def _folder(self, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
        """PEFT's adapter folder (no tokenizer files: vLLM serves the base's)."""
        return {"weights": published(weights), "config": self._adapter, "adapter": True}
