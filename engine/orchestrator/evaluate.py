"""Evaluation: a policy on environments' held-out splits, as avg@k and pass@k.

Each held-out task is played k times at the configured sampling (and once greedily when asked).
avg@k is the mean reward over all k·N rollouts; pass@k is the unbiased estimate of the chance
that at least one of k samples reaches the pass threshold (Chen et al., 2021), so pass@1 is the
plain pass rate. A rollout that could not be scored (environment error, prompt too long, nothing
sampled, NaN reward) counts as reward 0 and a failure, and is counted by reason. Per-sample
results go to `results.arrow` and the numbers to `summary.json`, committed together under
`<run>/eval/<name>/step_N/` (`storage.evals`).
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

from engine.config.evaluation import EvalConfig
from engine.config.orchestrator import SamplingConfig
from engine.envs import Environment, MixEntry, Rollout, TurnGenerator, assemble
from engine.orchestrator.samples import skip_reason


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from `n` samples of which `c` passed: 1 - C(n-c, k) / C(n, k)."""
    if not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 < k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass(frozen=True)
class Scored:
    """One evaluated rollout."""

    rollout: Rollout
    sample: int
    reward: float  # 0 for rollouts that could not be scored
    passed: bool
    skip: str | None


def summarize(scored: Sequence[Scored], k: int) -> dict[str, Any]:
    """avg@k, pass@1, pass@k and companions over one environment's evaluated rollouts."""
    by_example: dict[int, list[Scored]] = {}
    for item in scored:
        by_example.setdefault(item.rollout.example_id, []).append(item)
    rewards = [item.reward for item in scored]
    mean = math.fsum(rewards) / len(rewards) if rewards else 0.0
    lengths = [sum(len(t.completion_ids) for t in item.rollout.turns) for item in scored]
    return {
        "examples": len(by_example),
        "samples": len(scored),
        f"avg@{k}": mean,
        "reward_std": math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / len(rewards))
        if rewards
        else 0.0,
        "pass@1": _mean_pass(by_example.values(), 1),
        f"pass@{k}": _mean_pass(by_example.values(), k),
        "completion_len_mean": math.fsum(lengths) / len(lengths) if lengths else 0.0,
        "truncated_rate": (
            sum(item.rollout.is_truncated for item in scored) / len(scored) if scored else 0.0
        ),
        "skipped": dict(Counter(item.skip for item in scored if item.skip)),
    }


def _mean_pass(groups: Any, k: int) -> float:
    values = [pass_at_k(len(g), sum(item.passed for item in g), k) for g in groups if len(g) >= k]
    return math.fsum(values) / len(values) if values else 0.0


def score(rollouts: Sequence[Rollout], threshold: float) -> list[Scored]:
    scored = []
    for index, rollout in enumerate(rollouts):
        skip = skip_reason(rollout)
        reward = 0.0 if skip else rollout.reward
        scored.append(Scored(rollout, index, reward, skip is None and reward >= threshold, skip))
    return scored


async def play(
    env: Environment,
    generator: TurnGenerator,
    sampling: SamplingConfig,
    *,
    num_examples: int,
    k: int,
    max_concurrent: int,
    threshold: float,
) -> list[Scored]:
    """Play the first `num_examples` held-out tasks `k` times each; every rollout scored."""
    tasks = env.tasks("eval")
    gate = asyncio.Semaphore(max(1, max_concurrent // k))

    async def one(index: int) -> list[Scored]:
        async with gate:
            return score(await env.run_group(tasks[index], k, generator, sampling), threshold)

    groups = await asyncio.gather(*(one(i) for i in range(min(num_examples, len(tasks)))))
    return [item for group in groups for item in group]


def rows(
    scored: Sequence[Scored], mode: str, sampling: SamplingConfig, decode: Any
) -> list[dict[str, Any]]:
    """`EVAL_SCHEMA` rows: the decoded prompt and completion beside each score."""
    out = []
    for item in scored:
        rollout = item.rollout
        sequences = assemble(rollout.turns) if rollout.turns else []
        prompt = decode(sequences[0].token_ids[: sequences[0].prompt_len]) if sequences else ""
        completion = "".join(decode(s.token_ids[s.prompt_len :]) for s in sequences)
        out.append(
            {
                "env": rollout.env,
                "example_id": rollout.example_id,
                "mode": mode,
                "sample": item.sample,
                "reward": rollout.reward if item.skip is None else math.nan,
                "passed": item.passed,
                "skip_reason": item.skip,
                "error": rollout.error,
                "policy_version": min((s.policy_version for s in sequences), default=None),
                "temperature": sampling.temperature,
                "completion_tokens": sum(len(t.completion_ids) for t in rollout.turns),
                "is_truncated": rollout.is_truncated,
                "prompt_text": prompt,
                "completion_text": completion,
                "metrics": {key: float(value) for key, value in rollout.metrics.items()},
            }
        )
    return out


def summary_document(
    name: str, step: int, k: int, per_env: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """The `summary.json` document: per-environment numbers and their unweighted means."""
    headline = {}
    for key in (f"avg@{k}", "pass@1", f"pass@{k}"):
        values = [env[key] for env in per_env.values()]
        headline[key] = math.fsum(values) / len(values) if values else 0.0
    for mode in ("greedy",):
        values = [env[mode]["avg@1"] for env in per_env.values() if mode in env]
        if values:
            headline[f"{mode}/avg@1"] = math.fsum(values) / len(values)
    return {
        "name": name,
        "step": step,
        "k": k,
        "created_at": datetime.now(UTC).isoformat(),
        **headline,
        "envs": per_env,
    }


Decode = Callable[[list[int]], str]


def decoder(tokenizer: Any) -> Decode:
    """Token ids → text with special tokens kept (results show the raw completion)."""

    def decode(ids: list[int]) -> str:
        return cast(str, tokenizer.decode(ids, skip_special_tokens=False))

    return decode


async def evaluate_envs(
    config: EvalConfig,
    entries: Sequence[MixEntry],
    generator: TurnGenerator,
    decode: Decode,
    *,
    num_examples: int | None = None,
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Every environment's held-out tasks, sampled k times and (when asked) once greedily,
    both at once: the result rows and each environment's summary. `num_examples` overrides
    the config's (evaluations during RL take fewer)."""
    k = config.rollouts_per_example
    results: list[dict[str, Any]] = []
    per_env: dict[str, dict[str, Any]] = {}
    for entry in entries:
        threshold = (
            config.pass_threshold if config.pass_threshold is not None else entry.env.pass_threshold
        )
        play_env = functools.partial(
            play,
            entry.env,
            generator,
            num_examples=num_examples or config.num_examples,
            max_concurrent=config.max_concurrent,
            threshold=threshold,
        )
        greedy_sampling = entry.sampling.model_copy(update={"temperature": 0.0})
        plays = [play_env(entry.sampling, k=k)]
        if config.greedy:
            plays.append(play_env(greedy_sampling, k=1))
        sampled, *greedy = await asyncio.gather(*plays)
        per_env[entry.env.name] = {**summarize(sampled, k), "pass_threshold": threshold}
        results += rows(sampled, "sampled", entry.sampling, decode)
        if greedy:
            per_env[entry.env.name]["greedy"] = summarize(greedy[0], 1)
            results += rows(greedy[0], "greedy", greedy_sampling, decode)
    return results, per_env
