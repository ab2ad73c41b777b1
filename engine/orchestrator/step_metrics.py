"""Per-step metrics of the orchestrator: rewards, lengths, staleness, drops, throughput, and
whether the batch can teach anything (advantage health)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence

from engine.orchestrator.batch import StepBatch
from engine.orchestrator.filters import ZERO_TOLERANCE
from engine.orchestrator.samples import TrainSample

#: The metric of the groups that teach nothing, which the signal watch and the run report read.
ZERO_GROUP_FRACTION = "advantage/zero_group_fraction"


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else 0.0


def _std(values: Sequence[float]) -> float:
    if not values:
        return 0.0
    mean = _mean(values)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))


def advantage_health(samples: Sequence[TrainSample]) -> dict[str, float]:
    """How much of the batch carries a learning signal.

    `advantage/zero_group_fraction`: groups whose every sample has zero advantage (all rewards
    equal: too easy or too hard), which teach nothing; `advantage/nonzero_token_fraction`: the
    sampled tokens that carry a gradient; `advantage/group_reward_std`: the mean spread of
    rewards inside a group, the raw signal group-relative advantages divide up.
    """
    groups: dict[int, list[TrainSample]] = defaultdict(list)
    for sample in samples:
        groups[sample.group_id].append(sample)
    zero = [all(abs(s.advantage) <= ZERO_TOLERANCE for s in group) for group in groups.values()]
    tokens = [sample.sequence.sampled_tokens for sample in samples]
    signal = [n for n, s in zip(tokens, samples, strict=True) if abs(s.advantage) > ZERO_TOLERANCE]
    return {
        ZERO_GROUP_FRACTION: _mean([float(z) for z in zero]),
        "advantage/nonzero_token_fraction": sum(signal) / sum(tokens) if sum(tokens) else 0.0,
        "advantage/group_reward_std": _mean([_std([s.reward for s in g]) for g in groups.values()]),
    }


def step_metrics(batch: StepBatch, *, served_version: int, elapsed_s: float) -> dict[str, float]:
    """One JSON-able line for `batch`: what it holds, what was dropped and why, how fast."""
    samples = batch.samples
    lengths = [sample.sequence.sampled_tokens for sample in samples]
    lags = [served_version - sample.policy_version for sample in samples]
    all_rewards = [reward for rewards in batch.rewards.values() for reward in rewards]
    metrics: dict[str, float] = {
        "samples": len(samples),
        "tokens": batch.num_tokens,
        "sampled_tokens": sum(lengths),
        "reward/mean": _mean(all_rewards),
        "reward/std": _std(all_rewards),
        "advantage/abs_mean": _mean([abs(sample.advantage) for sample in samples]),
        **advantage_health(samples),
        "completion_len/mean": _mean(lengths),
        "completion_len/max": max(lengths, default=0),
        "completion_len/min": min(lengths, default=0),
        "truncated/rate": _mean([float(sample.is_truncated) for sample in samples]),
        "policy/served_version": served_version,
        "policy/oldest_version": min((s.policy_version for s in samples), default=served_version),
        "off_policy/lag_mean": _mean(lags),
        "off_policy/lag_max": max(lags, default=0),
        "time/step_s": elapsed_s,
        "throughput/samples_per_s": len(samples) / elapsed_s if elapsed_s > 0 else 0.0,
        "throughput/tokens_per_s": sum(lengths) / elapsed_s if elapsed_s > 0 else 0.0,
    }
    for env, rewards in sorted(batch.rewards.items()):
        metrics[f"reward/{env}/mean"] = _mean(rewards)
        metrics[f"reward/{env}/std"] = _std(rewards)
    for env, sampled in sorted(batch.sampled_tokens.items()):
        # Of the tokens sampled for this environment's groups that reached this step, the
        # share thrown away because the groups had fallen too far behind the policy.
        stale = batch.stale_tokens[env]
        metrics[f"tokens/{env}/sampled"] = sampled
        metrics[f"tokens/{env}/stale"] = stale
        metrics[f"stale/{env}/token_fraction"] = stale / sampled if sampled else 0.0
    token_lags = [
        served_version - version
        for sample in samples
        for version in sample.sequence.token_versions
        if version >= 0
    ]
    metrics["off_policy/token_lag_mean"] = _mean(token_lags)
    for key, value in sorted(batch.counts.items()):
        metrics[f"count/{key}"] = value
    return metrics


def mix_shares(
    ratios: Mapping[str, float], trained: Mapping[str, int], window: Mapping[str, int]
) -> dict[str, float]:
    """`mix/<env>/requested` (its normalised ratio) beside `mix/<env>/trained` (its share of
    this step's samples) and `mix/<env>/trained_window` (of the last steps' samples)."""
    total_ratio = math.fsum(ratios.values())
    step_total, window_total = sum(trained.values()), sum(window.values())
    metrics = {}
    for env, ratio in ratios.items():
        metrics[f"mix/{env}/requested"] = ratio / total_ratio
        metrics[f"mix/{env}/trained"] = trained[env] / step_total if step_total else 0.0
        metrics[f"mix/{env}/trained_window"] = window[env] / window_total if window_total else 0.0
    return metrics
