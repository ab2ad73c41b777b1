"""Per-token losses: AIPO (default), the masked-ratio variant, SFT cross-entropy, and plugins.

Every loss maps flat per-token tensors of one micro-batch ([T] each, T = rows × seq_len) to a
per-token loss [T] plus per-token metric values [T]. The caller sums them over loss tokens and
divides by the number of loss tokens of the whole step across all ranks (`normalise`), so a
token weighs the same however the batch was split into micro-batches and ranks: the 1-rank and
the N-rank step compute the same gradient.

The formulas, with r = π_train(y|x) / π_inference(y|x) per sampled token and sg = stop-gradient:

- AIPO:          ℓ = -sg(min(r, cap)) · A · log π_train        (truncated importance weight, no KL)
- masked ratio:  ℓ = -m · sg(r) · A · log π_train + β · (log r)²,   m = [low ≤ r ≤ high]
- SFT:           ℓ = -log π_train

docs/algorithms.md derives them and says when to use which.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor

from engine.config.trainer import AipoLossConfig, LossConfig, MaskedRatioLossConfig


@dataclass(frozen=True)
class LossInputs:
    """Flat per-token tensors of one micro-batch, all [T] and aligned.

    `logprobs` are the trainer's temperature-scaled log-probabilities of the target tokens (they
    carry the gradient); `inference_logprobs` and `advantages` come from the rollout shard.
    """

    logprobs: Tensor  # [T] float32, requires grad
    inference_logprobs: Tensor  # [T] float32
    advantages: Tensor  # [T] float32
    loss_mask: Tensor  # [T] bool


@dataclass(frozen=True)
class LossOutputs:
    """`token_loss` [T] and per-token metric values [T]; both are read on loss tokens only."""

    token_loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


LossFn = Callable[[LossInputs], LossOutputs]


def log_ratio(inputs: LossInputs) -> Tensor:
    """[T] log π_train − log π_inference on loss tokens; 0 elsewhere (no inference log-prob)."""
    return torch.where(inputs.loss_mask, inputs.logprobs - inputs.inference_logprobs, 0.0)


def mismatch_kl(inputs: LossInputs) -> Tensor:
    """[T] k3 estimate of KL(π_inference ‖ π_train) per sampled token: r − 1 − log r ≥ 0.

    Tokens were sampled from π_inference, which makes k3 unbiased and never negative; it measures
    how far the trainer's numerics (or staleness) moved the policy from what generated the data.
    """
    lr = log_ratio(inputs).detach().clamp(-20.0, 20.0)
    return torch.expm1(lr) - lr


def aipo_loss(inputs: LossInputs, *, ratio_cap: float) -> LossOutputs:
    """AIPO: importance-weighted policy gradient with the weight truncated at `ratio_cap`.

    Tokens above the cap still learn, with weight `ratio_cap`; clamping the log-ratio before
    `exp` keeps a wild token from overflowing to inf.
    """
    lr = log_ratio(inputs).detach()
    weight = torch.exp(lr.clamp(max=math.log(ratio_cap)))
    token_loss = -weight * inputs.advantages * inputs.logprobs
    capped = (lr > math.log(ratio_cap)).float()
    return LossOutputs(
        token_loss=token_loss,
        metrics={"ratio": weight, "capped_fraction": capped, "mismatch_kl": mismatch_kl(inputs)},
    )


def masked_ratio_loss(
    inputs: LossInputs, *, ratio_low: float, ratio_high: float, kl_coef: float
) -> LossOutputs:
    """Importance-weighted policy gradient where low ≤ r ≤ high, plus β·(log r)² everywhere.

    Masked tokens get no policy-gradient term (their data is too off-policy to trust), but the
    KL term on every loss token still pulls the trainer back towards the inference policy.
    """
    lr = log_ratio(inputs)
    keep = (lr.detach() >= math.log(ratio_low)) & (lr.detach() <= math.log(ratio_high))
    weight = torch.exp(lr.detach().clamp(max=math.log(ratio_high)))
    policy = -torch.where(keep, weight * inputs.advantages * inputs.logprobs, 0.0)
    token_loss = policy + kl_coef * lr.square()
    return LossOutputs(
        token_loss=token_loss,
        metrics={
            "ratio": torch.exp(lr.detach().clamp(-20.0, 20.0)),
            "masked_fraction": (~keep).float(),
            "mismatch_kl": mismatch_kl(inputs),
        },
    )


def sft_loss(inputs: LossInputs) -> LossOutputs:
    """Cross-entropy (negative log-likelihood) of the target tokens."""
    return LossOutputs(token_loss=-inputs.logprobs)


def build_loss(config: LossConfig) -> LossFn:
    """The RL loss the config selects."""
    if isinstance(config, AipoLossConfig):
        return partial(aipo_loss, ratio_cap=config.ratio_cap)
    if isinstance(config, MaskedRatioLossConfig):
        return partial(
            masked_ratio_loss,
            ratio_low=config.ratio_low,
            ratio_high=config.ratio_high,
            kl_coef=config.kl_coef,
        )
    return config.load("trainer.loss")


def masked_sums(outputs: LossOutputs, loss_mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Σ over loss tokens of the token loss (with grad) and of each metric (detached)."""
    mask = loss_mask.to(outputs.token_loss.dtype)
    loss_sum = (outputs.token_loss * mask).sum()
    metric_sums = {name: (value.detach() * mask).sum() for name, value in outputs.metrics.items()}
    return loss_sum, metric_sums


def normalise(loss_sum: Tensor, global_loss_tokens: int, world_size: int) -> Tensor:
    """The micro-batch's share of the step loss, ready for `backward()`.

    Dividing by the step's loss tokens over all ranks gives every token equal weight; the factor
    `world_size` undoes FSDP's averaging of gradients over ranks, so the summed gradient is that
    of the whole batch on one rank.
    """
    return loss_sum * (world_size / max(global_loss_tokens, 1))
