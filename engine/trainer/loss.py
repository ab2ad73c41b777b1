"""Per-token losses: AIPO (default), masked ratio, PPO clip, plain policy gradient, SFT
cross-entropy, and plugins.

Every loss maps flat per-token tensors of one micro-batch ([T] each, T = rows × seq_len) to a
per-token loss [T] plus per-token metric values [T]. The caller weighs them (`LossInputs.weights`:
1 per token, or per-sample weights for sequence normalisation), sums them over loss tokens and
divides by the number of loss tokens of the whole step across all ranks (`normalise`), so a
token weighs the same however the batch was split into micro-batches and ranks: the 1-rank and
the N-rank step compute the same gradient.

The formulas, with r = π_train(y|x) / π_inference(y|x) per sampled token and sg = stop-gradient:

- AIPO:          ℓ = -sg(min(r, cap)) · A · log π_train        (truncated importance weight, no KL)
- masked ratio:  ℓ = -m · sg(r) · A · log π_train + β · (log r)²,   m = [low ≤ r ≤ high]
- PPO clip:      ℓ = -min(r · A, clip(r, 1 - low, 1 + high) · A)   (GRPO's surrogate)
- policy grad.:  ℓ = -A · log π_train                               (no importance weight)
- SFT:           ℓ = -log π_train
- entropy bonus (any built-in RL loss): ℓ ← ℓ - c · H(π_train)

docs/algorithms.md derives them and says when to use which.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor

from engine.config.trainer import (
    AipoLossConfig,
    BuiltinLossConfig,
    LossConfig,
    MaskedRatioLossConfig,
    PolicyGradientLossConfig,
    PpoClipLossConfig,
)


@dataclass(frozen=True)
class LossInputs:
    """Flat per-token tensors of one micro-batch, all [T] and aligned.

    `logprobs` are the trainer's temperature-scaled log-probabilities of the target tokens (they
    carry the gradient), `entropy` the entropy of the distribution each was drawn from (with a
    gradient too, for the entropy bonus); `inference_logprobs` and `advantages` come from the
    rollout shard.
    """

    logprobs: Tensor  # [T] float32, requires grad
    inference_logprobs: Tensor  # [T] float32
    advantages: Tensor  # [T] float32
    loss_mask: Tensor  # [T] bool
    entropy: Tensor | None = None  # [T] float32


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


def ppo_clip_loss(inputs: LossInputs, *, clip_low: float, clip_high: float) -> LossOutputs:
    """PPO's clipped surrogate against the inference policy, as GRPO uses it.

    A token whose ratio has already moved past the clip in its advantage's direction gets no
    gradient; with one optimizer step per batch that happens only as far as staleness and
    numerics moved the trainer from the sampler.
    """
    lr = log_ratio(inputs)
    ratio = torch.exp(lr.clamp(-20.0, 20.0))
    advantages = inputs.advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    token_loss = -torch.minimum(ratio * advantages, clipped * advantages)
    r = ratio.detach()
    return LossOutputs(
        token_loss=token_loss,
        metrics={
            "ratio": r,
            "clip_low_fraction": ((r < 1.0 - clip_low) & (advantages < 0)).float(),
            "clip_high_fraction": ((r > 1.0 + clip_high) & (advantages > 0)).float(),
            "mismatch_kl": mismatch_kl(inputs),
        },
    )


def policy_gradient_loss(inputs: LossInputs) -> LossOutputs:
    """−A · log π_train: every token weighs 1, whatever sampled it.

    On-policy this is the GRPO update of a trainer that samples with its own weights (its
    ratio is exactly 1); against vLLM's samples it ignores the trainer–inference mismatch the
    other losses correct for, which the `ratio` and `mismatch_kl` metrics still report.
    """
    lr = log_ratio(inputs).detach()
    return LossOutputs(
        token_loss=-inputs.advantages * inputs.logprobs,
        metrics={"ratio": torch.exp(lr.clamp(-20.0, 20.0)), "mismatch_kl": mismatch_kl(inputs)},
    )


def with_entropy_bonus(loss_fn: LossFn, coef: float) -> LossFn:
    """`loss_fn` minus `coef` × the per-token entropy: a push back against entropy collapse."""

    def loss(inputs: LossInputs) -> LossOutputs:
        if inputs.entropy is None:
            raise ValueError("the entropy bonus needs LossInputs.entropy")
        outputs = loss_fn(inputs)
        return LossOutputs(outputs.token_loss - coef * inputs.entropy, outputs.metrics)

    return loss


def sft_loss(inputs: LossInputs) -> LossOutputs:
    """Cross-entropy (negative log-likelihood) of the target tokens."""
    return LossOutputs(token_loss=-inputs.logprobs)


def _builtin(config: BuiltinLossConfig) -> LossFn:
    if isinstance(config, AipoLossConfig):
        return partial(aipo_loss, ratio_cap=config.ratio_cap)
    if isinstance(config, MaskedRatioLossConfig):
        return partial(
            masked_ratio_loss,
            ratio_low=config.ratio_low,
            ratio_high=config.ratio_high,
            kl_coef=config.kl_coef,
        )
    if isinstance(config, PolicyGradientLossConfig):
        return policy_gradient_loss
    assert isinstance(config, PpoClipLossConfig)
    return partial(ppo_clip_loss, clip_low=config.clip_low, clip_high=config.clip_high)


def build_loss(config: LossConfig) -> LossFn:
    """The RL loss the config selects (with its entropy bonus, when set)."""
    if not isinstance(config, BuiltinLossConfig):
        return config.load("trainer.loss")
    loss_fn = _builtin(config)
    return with_entropy_bonus(loss_fn, config.entropy_coef) if config.entropy_coef else loss_fn


def loss_normalization(config: LossConfig) -> str:
    """How the step weighs its samples: "token" or "sequence" (custom losses: "token")."""
    return config.normalization if isinstance(config, BuiltinLossConfig) else "token"


def sequence_weights(loss_tokens: Sequence[int]) -> list[float]:
    """Per-sample token weights that make every sample count the same in the step's loss.

    Sample i's tokens get weight L / (N · n_i), with n_i its loss tokens, N samples and L their
    total: each sample's weights sum to L / N, the step's to L, so `normalise`'s division by L
    averages each sample's tokens first and then the samples (GRPO's original normalisation).
    """
    total, count = sum(loss_tokens), len(loss_tokens)
    return [total / (count * n) if n else 0.0 for n in loss_tokens]


def masked_sums(
    outputs: LossOutputs, loss_mask: Tensor, weights: Tensor | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Σ over loss tokens of the (weighted) token loss, with grad, and of each metric (detached,
    unweighted: a metric stays a mean over tokens)."""
    mask = loss_mask.to(outputs.token_loss.dtype)
    weighted = mask if weights is None else mask * weights
    loss_sum = (outputs.token_loss * weighted).sum()
    metric_sums = {name: (value.detach() * mask).sum() for name, value in outputs.metrics.items()}
    return loss_sum, metric_sums


def normalise(loss_sum: Tensor, global_loss_tokens: int, world_size: int) -> Tensor:
    """The micro-batch's share of the step loss, ready for `backward()`.

    Dividing by the step's loss tokens over all ranks gives every token equal weight; the factor
    `world_size` undoes FSDP's averaging of gradients over ranks, so the summed gradient is that
    of the whole batch on one rank.
    """
    return loss_sum * (world_size / max(global_loss_tokens, 1))
