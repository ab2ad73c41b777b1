"""Per-step metrics of the orchestrator: rewards, lengths, staleness, drops, throughput."""

from __future__ import annotations

import math
from collections.abc import Sequence

from engine.orchestrator.batch import StepBatch


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else 0.0


def _std(values: Sequence[float]) -> float:
    if not values:
        return 0.0
    mean = _mean(values)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))


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
    for key, value in sorted(batch.counts.items()):
        metrics[f"count/{key}"] = value
    return metrics
