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
different number of ranks (RNG states are then left as they are); a checkpoint costs one
gather, which is cheap at the sizes one node trains.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
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
from engine.trainer.distributed import DistInfo
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

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
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


def _optimizer_tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """`{param: {exp_avg, exp_avg_sq, step}}` → `{"optimizer/param/exp_avg": tensor}`."""
    return {
        f"{OPTIMIZER_PREFIX}{param}/{name}": value.detach().cpu()
        for param, values in state.items()
        for name, value in values.items()
    }


def _optimizer_state(tensors: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith(OPTIMIZER_PREFIX):
            param, name = key.removeprefix(OPTIMIZER_PREFIX).rsplit("/", 1)
            state.setdefault(param, {})[name] = value
    return state


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def save_checkpoint(
    store: ObjectStore,
    step: int,
    policy: PolicyModel,
    optimizer: Optimizer,
    scheduler: LRScheduler,
    dist_info: DistInfo,
    *,
    progress: Mapping[str, Any],
    files: Mapping[str, bytes],
    config: CheckpointConfig,
) -> None:
    """Gather and commit `checkpoints/step_<step>`, then apply retention (collective).

    `progress` is the data position (JSON); `files` are tokenizer/generation files to ship.
    """
    weights = get_model_state_dict(policy, options=_FULL)
    optim_state = get_optimizer_state_dict(policy, optimizer, options=_FULL)
    rng_states: list[dict[str, torch.Tensor] | None] = [None] * dist_info.world_size
    dist.all_gather_object(rng_states, _rng_state(dist_info.device))
    if dist_info.is_main:
        tied = tied_head_key(policy)
        if tied is not None:
            weights.pop(tied, None)
        trainer_tensors = _optimizer_tensors(optim_state["state"])
        for rank, states in enumerate(rng_states):
            for device, tensor in (states or {}).items():
                trainer_tensors[f"{RNG_PREFIX}rank{rank}/{device}"] = tensor
        write_checkpoint(
            store,
            step,
            weights={name: tensor.float() for name, tensor in weights.items()},
            config=policy.config.to_dict(),
            files=files,
            trainer_state=trainer_tensors,
            progress={
                "step": step,
                "world_size": dist_info.world_size,
                "data": dict(progress),
                "param_groups": optim_state["param_groups"],
                "scheduler": scheduler.state_dict(),
            },
            max_shard_bytes=int(config.max_shard_gb * 2**30),
        )
        apply_retention(store, keep_last=config.keep_last, keep_every=config.keep_every)
    dist.barrier()


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
