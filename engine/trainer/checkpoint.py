"""Checkpoints: a Hugging Face folder plus the trainer state for exact resume.

Written and read through `storage.checkpoints` (commit protocol, verified fetch, retention).
The trainer's part is what goes in:

- weights: the full fp32 state dict gathered from the FSDP shards, with a tied LM head left out
  as Hugging Face does, so `transformers` and vLLM load the folder as it is; `config.json` keeps
  the base model's dtype, so servers still load it in bf16;
- trainer tensors (safetensors): AdamW moments and step per parameter name
  (`optimizer/<param>/<state>`) and every rank's CPU/CUDA generator (`rng/rank<r>/<device>`);
- progress (JSON): step, data position, scheduler, optimizer hyper-parameters, world size.

Nothing is unpickled on resume. State dicts are full (unsharded), so a run can resume on a
different number of ranks (RNG states are then left as they are).

A checkpoint is written in the background (`CheckpointWriter`): the trainer *snapshots* the
state (every tensor gathered one at a time and copied into host memory on rank 0, pinned on
CUDA) and goes on training while a thread writes and commits it. Only the snapshot stalls the
step; one checkpoint is in flight at a time, and a stage returns only once its last one is
committed.
"""

from __future__ import annotations

import copy
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from engine.config.trainer import CheckpointConfig
from engine.trainer.background import BackgroundWrite
from engine.trainer.distributed import DistInfo
from engine.trainer.host_copies import HostCopies
from engine.trainer.model import PolicyModel
from storage.checkpoints import (
    apply_retention,
    fetch_checkpoint,
    load_checkpoint_weights,
    load_trainer_state,
    write_checkpoint,
)
from storage.commit import latest_committed_step
from storage.layout import RunLayout
from storage.store import ObjectStore

_SHARDED = StateDictOptions(full_state_dict=False)
OPTIMIZER_PREFIX = "optimizer/"
RNG_PREFIX = "rng/"


def tied_head_key(policy: PolicyModel) -> str | None:
    """The LM head's weight name when it is tied to the input embeddings (stored once)."""
    if getattr(policy.config, "tie_word_embeddings", False):
        return f"{policy.head_name}.weight"
    return None


def _embedding_key(policy: PolicyModel) -> str:
    embeddings = policy.base.get_input_embeddings()
    return next(
        f"{policy.base_name}.{name}.weight"
        for name, module in policy.base.named_modules()
        if module is embeddings
    )


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _optimizer_state(tensors: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith(OPTIMIZER_PREFIX):
            param, name = key.removeprefix(OPTIMIZER_PREFIX).rsplit("/", 1)
            state.setdefault(param, {})[name] = value
    return state


@dataclass(frozen=True)
class StateSnapshot:
    """A step's trainer state in rank 0's host memory: what `write_checkpoint` takes."""

    step: int
    weights: dict[str, torch.Tensor]
    trainer_tensors: dict[str, torch.Tensor]
    progress: dict[str, Any]


def snapshot_state(
    policy: PolicyModel,
    optimizer: Optimizer,
    scheduler: LRScheduler,
    dist_info: DistInfo,
    *,
    step: int,
    progress: Mapping[str, Any],
) -> StateSnapshot | None:
    """Copy what an exact resume needs to rank 0's host (None elsewhere); collective.

    One tensor is gathered at a time, so no rank holds a second copy of the model on the
    device. Copies, not views: training goes on while a thread writes them.
    """
    tied = tied_head_key(policy)
    keep = dist_info.is_main
    weights = HostCopies(dist_info)
    for name, tensor in get_model_state_dict(policy, options=_SHARDED).items():
        if name != tied:
            weights.add(name, tensor, keep=keep, dtype=torch.float32)
    optim_state = get_optimizer_state_dict(policy, optimizer, options=_SHARDED)
    trainer_tensors = HostCopies(dist_info)
    for param, values in optim_state["state"].items():
        for name, value in values.items():
            trainer_tensors.add(f"{OPTIMIZER_PREFIX}{param}/{name}", value, keep=keep)
    rng_states: list[dict[str, torch.Tensor] | None] = [None] * dist_info.world_size
    dist.all_gather_object(rng_states, _rng_state(dist_info.device))
    weight_copies, tensors = weights.done(), trainer_tensors.done()
    if not dist_info.is_main:
        return None
    for rank, states in enumerate(rng_states):
        for device, tensor in (states or {}).items():
            tensors[f"{RNG_PREFIX}rank{rank}/{device}"] = tensor
    return StateSnapshot(
        step=step,
        weights=weight_copies,
        trainer_tensors=tensors,
        progress=copy.deepcopy(
            {
                "step": step,
                "world_size": dist_info.world_size,
                "data": dict(progress),
                "param_groups": optim_state["param_groups"],
                "scheduler": scheduler.state_dict(),
            }
        ),
    )


class CheckpointWriter:
    """Resume checkpoints of one stage, snapshotted on the step and written in the background.

    `files` are tokenizer/generation files to ship; `config` the retention and shard size.
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

    def save(self, step: int, progress: Mapping[str, Any]) -> float:
        """Snapshot checkpoint `step` and commit it in the background (collective).

        Returns the seconds the step stalled: waiting for the previous checkpoint and taking
        the snapshot. A failed earlier checkpoint is raised here.
        """
        started = time.perf_counter()
        self.flush()
        snapshot = snapshot_state(
            self.policy,
            self.optimizer,
            self.scheduler,
            self.dist_info,
            step=step,
            progress=progress,
        )
        if snapshot is not None:
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
        write_checkpoint(
            self.store,
            snapshot.step,
            weights=snapshot.weights,
            config=self.policy.config.to_dict(),
            files=self.files,
            trainer_state=snapshot.trainer_tensors,
            progress=snapshot.progress,
            max_shard_bytes=int(self.config.max_shard_gb * 2**30),
        )
        apply_retention(
            self.store, keep_last=self.config.keep_last, keep_every=self.config.keep_every
        )


def latest_checkpoint(store: ObjectStore) -> int | None:
    """The newest committed checkpoint step, or None (a half-written one is never chosen)."""
    return latest_committed_step(store, RunLayout.CHECKPOINTS)


def load_checkpoint(
    store: ObjectStore,
    step: int,
    policy: PolicyModel,
    optimizer: Optimizer,
    scheduler: LRScheduler,
    dist_info: DistInfo,
) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler and RNG from committed `step`; return its data
    position."""
    with tempfile.TemporaryDirectory(prefix="primeflow-resume-") as tmp:
        folder = fetch_checkpoint(store, step, Path(tmp) / "ckpt", trainer_state=True)
        weights = load_checkpoint_weights(folder)
        state = load_trainer_state(folder)
    tied = tied_head_key(policy)
    if tied is not None:
        weights[tied] = weights[_embedding_key(policy)]
    progress = state.progress
    set_model_state_dict(policy, weights, options=StateDictOptions(full_state_dict=True))
    set_optimizer_state_dict(
        policy,
        optimizer,
        {"state": _optimizer_state(state.tensors), "param_groups": progress["param_groups"]},
        options=StateDictOptions(full_state_dict=True),
    )
    scheduler.load_state_dict(progress["scheduler"])
    if progress["world_size"] == dist_info.world_size:
        torch.set_rng_state(state.tensors[f"{RNG_PREFIX}rank{dist_info.rank}/cpu"])
        cuda = state.tensors.get(f"{RNG_PREFIX}rank{dist_info.rank}/cuda")
        if dist_info.device.type == "cuda" and cuda is not None:
            torch.cuda.set_rng_state(cuda, dist_info.device)
    return progress["data"]
