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
state (every tensor gathered one at a time and copied into the host memory of the rank that
owns it, pinned on CUDA, behind the next step: `host_copies`) and goes on training while a
thread on every rank writes its files and rank 0 commits them all. Only issuing the snapshot
stalls the step; one checkpoint is in flight at a time, and a stage returns only once its
last one is committed.
"""

from __future__ import annotations

import copy
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    OptimizerStateType,
    StateDictOptions,
    ValueType,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from engine.config.trainer import CheckpointConfig
from engine.trainer.background import BackgroundWrite
from engine.trainer.distributed import DistInfo, shared_uid
from engine.trainer.host_copies import Fence, HostCopies, warm_pinned_memory
from engine.trainer.lora import adapter_config, published, trainer_name
from engine.trainer.model import PolicyModel
from engine.trainer.owners import assign_owners
from storage.checkpoints import (
    TRAINER_DIR,
    TRAINER_STATE_STEM,
    WEIGHTS_STEM,
    apply_retention,
    commit_sharded_checkpoint,
    fetch_checkpoint,
    load_checkpoint_weights,
    load_trainer_state,
    log_commit,
    write_checkpoint,
    write_tensor_file,
)
from storage.commit import FileDigest, begin_step, latest_committed_step
from storage.layout import RunLayout
from storage.parts import gather_parts
from storage.store import ObjectStore
from storage.tensor_files import shard_file_name, ties_word_embeddings

_SHARDED = StateDictOptions(full_state_dict=False)
OPTIMIZER_PREFIX = "optimizer/"
RNG_PREFIX = "rng/"


def tied_head_key(policy: PolicyModel) -> str | None:
    """The LM head's weight name when it is tied to the input embeddings (stored once)."""
    if ties_word_embeddings(policy.config.to_dict()):
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
    """The part of a step's trainer state this rank writes, in its host memory.

    `weights` and `trainer_tensors` are the whole tensors this rank owns (`owners`: all of
    them with one rank); `files` names the file each tensor of the checkpoint goes to, so
    rank 0 can write the indexes; `progress` is rank 0's (empty elsewhere). The copies are
    complete once `fence` says so.
    """

    step: int
    uid: str
    weights: dict[str, torch.Tensor]
    trainer_tensors: dict[str, torch.Tensor]
    files: dict[str, str]
    sizes: dict[str, int]
    progress: dict[str, Any]
    fence: Fence


def state_file(stem: str, rank: int, world: int) -> str:
    """Where rank `rank`'s tensors of `stem` go: one file with one rank, else one per rank."""
    return f"{stem}.safetensors" if world == 1 else shard_file_name(stem, rank + 1, world)


def model_tensors(policy: PolicyModel) -> list[tuple[str, torch.Tensor]]:
    """The (sharded) parameters and buffers a checkpoint stores, by name: all of them, or a
    LoRA run's adapters alone (the base is never rewritten); a tied LM head is stored once, as
    Hugging Face does. Named once per stage: naming them costs milliseconds."""
    # Typed as any state value: a module's state dict holds tensors only.
    state = cast(dict[str, torch.Tensor], get_model_state_dict(policy, options=_SHARDED))
    if policy.lora is not None:
        return [(name, state[name]) for name, _ in policy.trainable()]
    tied = tied_head_key(policy)
    return [(name, tensor) for name, tensor in state.items() if name != tied]


def snapshot_state(
    params: Sequence[tuple[str, torch.Tensor]],
    policy: PolicyModel,
    optimizer: Optimizer,
    scheduler: LRScheduler,
    dist_info: DistInfo,
    *,
    step: int,
    progress: Mapping[str, Any],
    owners: Mapping[str, int],
) -> StateSnapshot:
    """Copy what an exact resume needs (`params`: `model_tensors`) to host memory, each whole
    tensor to the rank that owns its parameter (`owners`); collective.

    One tensor is gathered at a time, so no rank holds a second copy of the model on the
    device. Copies, not views: training goes on while a thread writes them.
    """
    rank, world = dist_info.rank, dist_info.world_size
    # What reads a result on the host (the collectives, naming the optimizer state) comes
    # before any copy is queued, so none of it can make the host wait for the copies.
    rng_states: list[dict[str, torch.Tensor] | None] = [None] * world
    dist.all_gather_object(rng_states, _rng_state(dist_info.device))
    uid = shared_uid(dist_info)
    optim_state = _optimizer_state_dict(policy, optimizer)
    copies = HostCopies(dist_info)
    files: dict[str, str] = {}
    for name, tensor in params:
        owner = owners.get(name, 0)
        copies.add(name, tensor, keep=owner == rank, dtype=torch.float32)
        files[name] = state_file(WEIGHTS_STEM, owner, world)
    for param, values in optim_state["state"].items():
        owner = owners.get(param, 0)
        for name, value in values.items():
            key = f"{OPTIMIZER_PREFIX}{param}/{name}"
            copies.add(key, value, keep=owner == rank)
            files[key] = state_file(TRAINER_STATE_STEM, owner, world)
    tensors, fence = copies.done()
    weights = {n: t for n, t in tensors.items() if not n.startswith(OPTIMIZER_PREFIX)}
    trainer_tensors = {n: t for n, t in tensors.items() if n.startswith(OPTIMIZER_PREFIX)}
    for source, states in enumerate(rng_states):
        for device, tensor in (states or {}).items():
            key = f"{RNG_PREFIX}rank{source}/{device}"
            files[key] = state_file(TRAINER_STATE_STEM, 0, world)
            copies.sizes[key] = tensor.numel() * tensor.element_size()
            if dist_info.is_main:
                trainer_tensors[key] = tensor
    return StateSnapshot(
        step=step,
        uid=uid,
        weights=weights,
        trainer_tensors=trainer_tensors,
        files=files,
        sizes=copies.sizes,
        progress=copy.deepcopy(
            {
                "step": step,
                "world_size": world,
                "data": dict(progress),
                "param_groups": optim_state["param_groups"],
                "scheduler": scheduler.state_dict(),
            }
        ),
        fence=fence,
    )


def _optimizer_state_dict(policy: PolicyModel, optimizer: Optimizer) -> dict[str, Any]:
    """The sharded optimizer state by parameter name.

    Names are found through the modules' registered parameters, which are the unsharded ones
    while FSDP2 leaves a module gathered: after a forward without a backward (an evaluation),
    the root and the last block, which are not resharded after forward. Resharding first
    registers the sharded parameters the optimizer holds again.
    """
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return get_optimizer_state_dict(policy, optimizer, options=_SHARDED)


def pinned_sizes(
    params: Sequence[tuple[str, torch.Tensor]], owners: Mapping[str, int], rank: int
) -> list[int]:
    """The host blocks this rank's snapshot takes: fp32 weights and AdamW's two fp32 moments
    of every parameter it owns."""
    return [
        4 * tensor.numel()
        for name, tensor in params
        if owners.get(name, 0) == rank
        for _ in range(3)
    ]


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


def load_adapter(policy: PolicyModel, weights: Mapping[str, torch.Tensor]) -> None:
    """Set a LoRA policy's adapters from a published adapter's tensors (PEFT's names); the
    base weights stay as loaded."""
    if policy.lora is None:
        raise ValueError("an adapter can only be loaded into a policy built with trainer.lora")
    adapter: dict[str, ValueType] = {trainer_name(name): tensor for name, tensor in weights.items()}
    expected = {name for name, _ in policy.trainable()}
    if set(adapter) != expected:
        missing, extra = sorted(expected - set(adapter)), sorted(set(adapter) - expected)
        raise ValueError(
            f"the adapter does not fit trainer.lora: missing {missing[:3]}, unexpected {extra[:3]}"
        )
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(policy, adapter, options=options)


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
    progress = state.progress
    if policy.lora is not None:
        load_adapter(policy, weights)
    else:
        tied = tied_head_key(policy)
        if tied is not None:
            weights[tied] = weights[_embedding_key(policy)]
        # The casts: torch types state dicts as dicts of any state value (invariant), and ours
        # hold tensors.
        set_model_state_dict(
            policy,
            cast(dict[str, ValueType], weights),
            options=StateDictOptions(full_state_dict=True),
        )
    optimizer_state = {
        "state": _optimizer_state(state.tensors),
        "param_groups": progress["param_groups"],
    }
    set_optimizer_state_dict(
        policy,
        optimizer,
        cast(OptimizerStateType, optimizer_state),
        options=StateDictOptions(full_state_dict=True),
    )
    scheduler.load_state_dict(progress["scheduler"])
    if progress["world_size"] == dist_info.world_size:
        torch.set_rng_state(state.tensors[f"{RNG_PREFIX}rank{dist_info.rank}/cpu"])
        cuda = state.tensors.get(f"{RNG_PREFIX}rank{dist_info.rank}/cuda")
        if dist_info.device.type == "cuda" and cuda is not None:
            torch.cuda.set_rng_state(cuda, dist_info.device)
    return cast(dict[str, Any], progress["data"])
