"""Resuming from a committed checkpoint: weights (or a LoRA run's adapter), optimizer,
scheduler and RNG, read through `storage.checkpoints` (verified fetch).

Nothing is unpickled on resume. State dicts are full (unsharded), so a run can resume on a
different number of ranks (RNG states are then left as they are).
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.checkpoint.state_dict import (
    OptimizerStateType,
    StateDictOptions,
    ValueType,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from engine.trainer.checkpoint_state import OPTIMIZER_PREFIX, RNG_PREFIX, tied_head_key
from engine.trainer.distributed import DistInfo
from engine.trainer.lora import trainer_name
from engine.trainer.model import PolicyModel
from storage.checkpoints import fetch_checkpoint, load_checkpoint_weights, load_trainer_state
from storage.commit import latest_committed_step
from storage.layout import RunLayout
from storage.store import ObjectStore


def _embedding_key(policy: PolicyModel) -> str:
    embeddings = policy.base.get_input_embeddings()
    return next(
        f"{policy.base_name}.{name}.weight"
        for name, module in policy.base.named_modules()
        if module is embeddings
    )


def _optimizer_state(tensors: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith(OPTIMIZER_PREFIX):
            param, name = key.removeprefix(OPTIMIZER_PREFIX).rsplit("/", 1)
            state.setdefault(param, {})[name] = value
    return state


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
