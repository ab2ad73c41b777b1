"""What a resume checkpoint holds, how its tensors are named, and the snapshot of it.

A checkpoint is a Hugging Face folder plus the trainer state for exact resume:

- weights: the full fp32 state dict gathered from the FSDP shards, with a tied LM head left out
  as Hugging Face does, so `transformers` and vLLM load the folder as it is; `config.json` keeps
  the base model's dtype, so servers still load it in bf16;
- trainer tensors (safetensors): AdamW moments and step per parameter name
  (`optimizer/<param>/<state>`) and every rank's CPU/CUDA generator (`rng/rank<r>/<device>`);
- progress (JSON): step, data position, scheduler, optimizer hyper-parameters, world size.

The names live here because three paths share them: the snapshot taken on the step (here),
the background write (`checkpoint_writer`) and the resume (`checkpoint_resume`); policy
publication reuses the tensor list and the per-rank file names.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from engine.trainer.distributed import DistInfo, shared_uid
from engine.trainer.host_copies import Fence, HostCopies
from engine.trainer.model import PolicyModel
from storage.checkpoints import TRAINER_STATE_STEM, WEIGHTS_STEM
from storage.tensor_files import shard_file_name, ties_word_embeddings

_SHARDED = StateDictOptions(full_state_dict=False)
OPTIMIZER_PREFIX = "optimizer/"
RNG_PREFIX = "rng/"


def tied_head_key(policy: PolicyModel) -> str | None:
    """The LM head's weight name when it is tied to the input embeddings (stored once)."""
    if ties_word_embeddings(policy.config.to_dict()):
        return f"{policy.head_name}.weight"
    return None


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
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
