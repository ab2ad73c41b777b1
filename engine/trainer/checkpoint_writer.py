"""Writing resume checkpoints in the background, through `storage.checkpoints` (commit
protocol, retention).

The trainer *snapshots* the state (`checkpoint_state.snapshot_state`: every tensor gathered one
at a time and copied into the host memory of the rank that owns it, pinned on CUDA, behind the
next step: `host_copies`) and goes on training while a thread on every rank writes its files
and rank 0 commits them all. Only issuing the snapshot stalls the step; one checkpoint is in
flight at a time, and a stage returns only once its last one is committed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from engine.config.trainer import CheckpointConfig
from engine.trainer.background import BackgroundWrite
from engine.trainer.checkpoint_state import (
    OPTIMIZER_PREFIX,
    RNG_PREFIX,
    StateSnapshot,
    model_tensors,
    pinned_sizes,
    snapshot_state,
    state_file,
)
from engine.trainer.distributed import DistInfo
from engine.trainer.host_copies import warm_pinned_memory
from engine.trainer.lora import adapter_config, published
from engine.trainer.model import PolicyModel
from engine.trainer.owners import assign_owners
from storage.checkpoints import (
    TRAINER_DIR,
    TRAINER_STATE_STEM,
    WEIGHTS_STEM,
    apply_retention,
    commit_sharded_checkpoint,
    log_commit,
    write_checkpoint,
    write_tensor_file,
)
from storage.commit import FileDigest, begin_step
from storage.layout import RunLayout
from storage.parts import gather_parts
from storage.store import ObjectStore


class CheckpointWriter:
    """Resume checkpoints of one stage, snapshotted on the step and written in the background.

    Every rank writes the whole tensors it owns (`assign_owners`; one file of weights and one
    of trainer state per rank), and rank 0 the indexes, the progress and the marker once every
    part is there (`storage.parts`). `files` are tokenizer/generation files to ship; `config`
    the retention and shard size.
    """

    def __init__(
        self,
        store: ObjectStore,
        policy: PolicyModel,
        optimizer: Optimizer,
        scheduler: LRScheduler,
        dist_info: DistInfo,
        *,
        files: Mapping[str, bytes],
        config: CheckpointConfig,
    ) -> None:
        self.store = store
        self.policy = policy
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.dist_info = dist_info
        self.files = dict(files)
        self.config = config
        self._writes = BackgroundWrite("a resume checkpoint")
        self._params = model_tensors(policy)
        sizes = {name: tensor.numel() for name, tensor in self._params}
        #: A LoRA run's checkpoint is its adapter (PEFT's folder, so a server can load it for
        #: an evaluation) and the adapter's optimizer state, small enough for rank 0 alone.
        self._adapter = adapter_config(policy.lora, policy.adapter_base) if policy.lora else None
        self._one_writer = dist_info.world_size == 1 or self._adapter is not None
        self._owners = assign_owners(sizes, 1 if self._one_writer else dist_info.world_size)
        self._warming: threading.Thread | None = None
        if dist_info.device.type == "cuda":
            self._warming = warm_pinned_memory(
                pinned_sizes(self._params, self._owners, dist_info.rank)
            )

    def save(self, step: int, progress: Mapping[str, Any]) -> float:
        """Snapshot checkpoint `step` and commit it in the background (collective).

        Returns the seconds the step stalled: waiting for the previous checkpoint and taking
        the snapshot (its copies go on behind the next step). A failed earlier checkpoint is
        raised here.
        """
        started = time.perf_counter()
        self._writes.close()
        if not self._one_writer and self.dist_info.is_main:
            begin_step(self.store, RunLayout.checkpoint_dir(step))
        self.flush()
        if self._warming is not None:
            self._warming.join()
            self._warming = None
        snapshot = snapshot_state(
            self._params,
            self.policy,
            self.optimizer,
            self.scheduler,
            self.dist_info,
            step=step,
            progress=progress,
            owners=self._owners,
        )
        snapshot.fence.guard(self.optimizer)
        self._writes.start(f"checkpoint-{step}", lambda: self._write(snapshot))
        return time.perf_counter() - started

    def flush(self) -> None:
        """Wait until the checkpoint in flight is committed (collective); raise its error."""
        self._writes.close()
        if dist.is_initialized():
            dist.barrier()
        self._writes.wait()

    def close(self) -> None:
        """Wait for the checkpoint in flight, if any, without raising."""
        self._writes.close()

    def _write(self, snapshot: StateSnapshot) -> None:
        snapshot.fence.wait()
        if self._one_writer:
            if not self.dist_info.is_main:
                return
            self._write_whole(snapshot)
        elif not self._write_part(snapshot):
            return
        log_commit(self.store, snapshot.step)
        apply_retention(
            self.store, keep_last=self.config.keep_last, keep_every=self.config.keep_every
        )

    def _write_whole(self, snapshot: StateSnapshot) -> None:
        """One writer: the whole checkpoint in one go."""
        weights, config, files = snapshot.weights, self.policy.config.to_dict(), self.files
        if self._adapter is not None:
            weights, config, files = published(weights), self._adapter, {}
        write_checkpoint(
            self.store,
            snapshot.step,
            weights=weights,
            config=config,
            files=files,
            trainer_state=snapshot.trainer_tensors,
            progress=snapshot.progress,
            max_shard_bytes=int(self.config.max_shard_gb * 2**30),
            adapter=self._adapter is not None,
        )

    def _write_part(self, snapshot: StateSnapshot) -> bool:
        """Several ranks: write this rank's files; rank 0 then commits them all (True)."""
        rank, world = self.dist_info.rank, self.dist_info.world_size
        step_dir = RunLayout.checkpoint_dir(snapshot.step)
        mine: dict[str, FileDigest] = {}
        for stem, tensors in (
            (WEIGHTS_STEM, snapshot.weights),
            (TRAINER_STATE_STEM, snapshot.trainer_tensors),
        ):
            if tensors:
                name = state_file(stem, rank, world)
                mine.update(write_tensor_file(self.store, step_dir, name, tensors))
        files = gather_parts(self.store, step_dir, mine, rank=rank, world=world, uid=snapshot.uid)
        if files is None:
            return False
        weights = {n: f for n, f in snapshot.files.items() if not _is_trainer_tensor(n)}
        state = {
            n: f.removeprefix(f"{TRAINER_DIR}/")
            for n, f in snapshot.files.items()
            if _is_trainer_tensor(n)
        }
        commit_sharded_checkpoint(
            self.store,
            snapshot.step,
            shards=files,
            weight_map=weights,
            total_size=sum(snapshot.sizes[n] for n in weights),
            config=self.policy.config.to_dict(),
            files=self.files,
            trainer_map=state,
            trainer_size=sum(snapshot.sizes[n] for n in state),
            progress=snapshot.progress,
        )
        return True


def _is_trainer_tensor(name: str) -> bool:
    return name.startswith((OPTIMIZER_PREFIX, RNG_PREFIX))
