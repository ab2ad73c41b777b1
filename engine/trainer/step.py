"""One optimizer step over a rank's micro-batches, shared by SFT and RL.

Gradients accumulate over micro-batches without synchronisation and are reduce-scattered once,
after the last one. Every micro-batch's loss is divided by the step's loss tokens over all ranks
(`loss.normalise`), so the update is that of the whole batch regardless of how it was split.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from engine.trainer.attention import document_kwargs, sdpa_priority, varlen_available
from engine.trainer.distributed import DistInfo, all_reduce_max, all_reduce_sum
from engine.trainer.loss import LossFn, LossInputs, masked_sums, normalise
from engine.trainer.model import PolicyModel
from engine.trainer.packing import PackedRows


@dataclass(frozen=True)
class StepContext:
    """What every step needs besides the data."""

    policy: PolicyModel
    dist: DistInfo
    compute_dtype: torch.dtype
    flops_per_token: float | None = None
    peak_flops: float | None = None

    @property
    def varlen(self) -> bool:
        return varlen_available(self.dist.device, self.compute_dtype)


def _tensor(array: np.ndarray, device: torch.device) -> Tensor:
    return torch.from_numpy(array).to(device, non_blocking=True)


def forward_micro_batch(
    ctx: StepContext, rows: PackedRows, loss_fn: LossFn
) -> tuple[Tensor, dict[str, Tensor]]:
    """Σ loss over the micro-batch's loss tokens (with grad) and detached metric sums."""
    device = ctx.dist.device
    loss_mask = _tensor(rows.loss_mask, device).reshape(-1)
    logprobs, entropy = ctx.policy(
        _tensor(rows.input_ids, device),
        _tensor(rows.position_ids, device),
        _tensor(rows.targets, device),
        _tensor(rows.temperatures, device),
        **document_kwargs(rows.doc_lens, rows.seq_len, device, ctx.varlen),
    )
    inputs = LossInputs(
        logprobs=logprobs,
        inference_logprobs=_tensor(rows.inference_logprobs, device).reshape(-1),
        advantages=_tensor(rows.advantages, device).reshape(-1),
        loss_mask=loss_mask,
        entropy=entropy,
    )
    outputs = loss_fn(inputs)
    weights = _tensor(rows.loss_weights, device).reshape(-1)
    loss_sum, metric_sums = masked_sums(outputs, loss_mask, weights)
    metric_sums["entropy"] = (entropy.detach() * loss_mask).sum()
    if "mismatch_kl" in outputs.metrics:
        stale = _tensor(rows.lags, device).reshape(-1) > 0
        metric_sums.update(lag_split(outputs.metrics["mismatch_kl"], loss_mask, stale))
    return loss_sum, metric_sums


def lag_split(kl: Tensor, loss_mask: Tensor, stale: Tensor) -> dict[str, Tensor]:
    """Sums that split the mismatch KL between samples drawn by the weights being trained and
    samples drawn by older ones (all [T]).

    On the fresh ones it is the trainer's and the sampler's numerics alone; on the stale ones
    it adds how far the policy moved since they were drawn, which is the size of recent
    updates. One number mixes the two, and the share of stale tokens moves it as much as either.
    """
    kl = kl.detach()
    on_stale = loss_mask & stale
    on_fresh = loss_mask & ~stale
    return {
        "lag_split/stale_tokens": on_stale.sum(),
        "lag_split/stale_kl": (kl * on_stale).sum(),
        "lag_split/fresh_tokens": on_fresh.sum(),
        "lag_split/fresh_kl": (kl * on_fresh).sum(),
    }


def lag_split_means(totals: dict[str, float]) -> dict[str, float]:
    """Takes `lag_split`'s sums (over all ranks) out of `totals`; the stale share of loss
    tokens and the mean mismatch KL of each kind that has tokens."""
    if "lag_split/stale_tokens" not in totals:
        return {}
    stale, stale_kl, fresh, fresh_kl = (
        totals.pop(f"lag_split/{key}")
        for key in ("stale_tokens", "stale_kl", "fresh_tokens", "fresh_kl")
    )
    means = {"stale_token_fraction": stale / max(stale + fresh, 1.0)}
    if stale:
        means["mismatch_kl_stale"] = stale_kl / stale
    if fresh:
        means["mismatch_kl_fresh"] = fresh_kl / fresh
    return means


def _clip(policy: PolicyModel, max_norm: float | None) -> Tensor:
    """Clip the global gradient norm (when configured); the norm before clipping, on the device.

    Nothing here reads the norm on the host, so the clip's kernels queue behind backward's.
    """
    norm = torch.nn.utils.clip_grad_norm_(
        [p for _, p in policy.trainable()], max_norm if max_norm is not None else math.inf
    )
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _step_if_informative(optimizer: Optimizer, norm: Tensor) -> None:
    """Step unless the gradient norm is inf/NaN (one bad batch must not wreck the weights) or
    exactly 0 (an RL batch where every group's rewards were equal: no signal).

    A zero gradient is not a no-op for AdamW: its momentum and weight decay keep moving the
    weights for tens of steps. On tool-math a policy whose format broke (every reward 0, every
    advantage 0) kept drifting that way for 12 steps, its entropy rising 0.23 -> 0.43 and its
    truncated replies 2 % -> 64 %, with nothing to learn from (docs/benchmarks.md).

    Fused AdamW (GPU) takes the verdict as a device tensor, the way `GradScaler` hands it over
    (`found_inf`: the kernel leaves weights, moments and step counts alone when it is nonzero),
    so the step never waits for the host to read the norm; that wait left the GPU idle ~10 ms a
    step. Other optimizers read the norm first.
    """
    if optimizer.defaults.get("fused"):
        optimizer.found_inf = (~torch.isfinite(norm) | (norm == 0)).float()  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]
    elif _informative(float(norm)):
        optimizer.step()


def _informative(grad_norm: float) -> bool:
    """Whether a step with this gradient norm updates the weights (finite and nonzero)."""
    return math.isfinite(grad_norm) and grad_norm > 0.0


def _advance(scheduler: LRScheduler) -> None:
    """The schedule moves on whether or not the step updated the weights. When a run's first
    steps are skipped (no signal yet, as in an agentic env where every group fails at first),
    PyTorch warns that the scheduler stepped before the optimizer: that order is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
        scheduler.step()


def _accumulate(sums: dict[str, Tensor], values: dict[str, Tensor]) -> None:
    """Add scalar tensors on the device, so micro-batches never wait for the host."""
    for name, value in values.items():
        sums[name] = sums[name] + value if name in sums else value


def _to_floats(sums: dict[str, Tensor]) -> dict[str, float]:
    """One device-to-host copy for all sums."""
    if not sums:
        return {}
    names = sorted(sums)
    values = torch.stack([sums[n].double() for n in names]).tolist()
    return dict(zip(names, values, strict=True))


def _summarise(sums: dict[str, float], loss_tokens: int) -> dict[str, float]:
    """Per-token means of the summed metrics (loss tokens of the whole step, all ranks), and
    the mismatch KL split by lag (`lag_split_means`, over the tokens of each kind)."""
    totals = dict(sums)
    split = lag_split_means(totals)
    denominator = max(loss_tokens, 1)
    return {**{name: value / denominator for name, value in totals.items()}, **split}


def train_step(
    ctx: StepContext,
    optimizer: Optimizer,
    scheduler: LRScheduler,
    micro_batches: Sequence[PackedRows],
    loss_fn: LossFn,
    global_loss_tokens: int,
    max_grad_norm: float | None,
) -> dict[str, float]:
    """Forward/backward every micro-batch, clip, step; return the step's metrics (all ranks)."""
    device = ctx.dist.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    sums: dict[str, Tensor] = {}
    for index, rows in enumerate(micro_batches):
        cast(FSDPModule, ctx.policy).set_requires_gradient_sync(index == len(micro_batches) - 1)
        with sdpa_priority(device):
            loss_sum, metric_sums = forward_micro_batch(ctx, rows, loss_fn)
            normalise(loss_sum, global_loss_tokens, ctx.dist.world_size).backward()
        _accumulate(sums, {"loss": loss_sum.detach(), **metric_sums})
    norm = _clip(ctx.policy, max_grad_norm)
    lr = optimizer.param_groups[0]["lr"]
    if global_loss_tokens > 0:
        _step_if_informative(optimizer, norm)
    optimizer.zero_grad(set_to_none=True)
    _advance(scheduler)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    grad_norm = float(norm)
    skipped = global_loss_tokens == 0 or not _informative(grad_norm)

    local_tokens = sum(int(rows.real_tokens().sum()) for rows in micro_batches)
    totals = all_reduce_sum({**_to_floats(sums), "tokens": local_tokens}, device)
    tokens = int(totals.pop("tokens"))
    metrics = _summarise(totals, global_loss_tokens)
    metrics.update(
        grad_norm=grad_norm,
        lr=lr,
        skipped=float(skipped),
        tokens=tokens,
        loss_tokens=global_loss_tokens,
        step_seconds=seconds,
        tokens_per_second=tokens / seconds,
    )
    if ctx.flops_per_token is not None and ctx.peak_flops:
        metrics["mfu"] = (
            metrics["tokens_per_second"]
            * ctx.flops_per_token
            / (ctx.peak_flops * ctx.dist.world_size)
        )
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        metrics["peak_memory_gib"] = all_reduce_max(peak, device)
    return metrics


@torch.no_grad()
def eval_step(
    ctx: StepContext, micro_batches: Sequence[PackedRows], loss_fn: LossFn, loss_tokens: int
) -> dict[str, float]:
    """Mean loss (and metrics) over the loss tokens of `micro_batches` on all ranks; no update."""
    ctx.policy.eval()
    sums: dict[str, Tensor] = {}
    try:
        for rows in micro_batches:
            with sdpa_priority(ctx.dist.device):
                loss_sum, metric_sums = forward_micro_batch(ctx, rows, loss_fn)
            _accumulate(sums, {"loss": loss_sum, **metric_sums})
    finally:
        ctx.policy.train()
    return _summarise(all_reduce_sum(_to_floats(sums), ctx.dist.device), loss_tokens)
