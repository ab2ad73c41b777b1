"""Held-out evaluation of the served policy during RL, every `eval.interval` policy versions.

A training batch's reward is measured at the sampling temperature, on training prompts, by a
policy that is already changing: it shows sampling getting sharper as well as the policy getting
better. What a user wants to see move is the held-out reward, greedy above all, so the
orchestrator evaluates the policy the pool serves at version 0 and then at the first version
past each multiple of the interval. While an evaluation runs it loads no newer version, so every
answer comes from one policy (the version in the line); the async bound lets sampling for the
next batches go on meanwhile. One metric line per evaluation, stage `eval-online`, step = the
policy version, its numbers under `eval/`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.config.evaluation import EvalConfig
from engine.envs import MixEntry, TurnGenerator
from engine.orchestrator.evaluate import Decode, evaluate_envs, summary_document
from storage.metrics import latest_metric_step, write_metrics
from storage.store import ObjectStore

logger = logging.getLogger(__name__)

#: The stage name of the evaluation lines under `<run>/metrics/`.
ONLINE_EVAL_STAGE = "eval-online"
#: Prefix of every number in those lines, so they sit apart in a merged table row.
PREFIX = "eval/"


def is_due(version: int, last: int | None, interval: int) -> bool:
    """Whether policy `version` is evaluated, the last evaluated one being `last` (None:
    none yet): version 0 and the first version in each later interval."""
    return last is None or version // interval > last // interval


def flat_numbers(summary: dict[str, Any]) -> dict[str, float]:
    """The summary's numbers as one flat metric line: headline means, then per environment
    (`eval/<env>/avg@2`, `eval/<env>/greedy/avg@1`, ...)."""
    line: dict[str, float] = {}
    for key, value in summary.items():
        if isinstance(value, int | float) and key not in ("step", "k"):
            line[f"{PREFIX}{key}"] = float(value)
    for env, numbers in summary["envs"].items():
        for key, value in numbers.items():
            if isinstance(value, int | float):
                line[f"{PREFIX}{env}/{key}"] = float(value)
            elif key == "greedy":
                for inner, number in value.items():
                    if isinstance(number, int | float):
                        line[f"{PREFIX}{env}/greedy/{inner}"] = float(number)
    return line


@dataclass(frozen=True)
class OnlineEval:
    """What the orchestrator needs to evaluate the served policy as RL goes on."""

    config: EvalConfig
    entries: Sequence[MixEntry]
    decode: Decode

    @property
    def interval(self) -> int:
        assert self.config.interval is not None
        return self.config.interval

    def last_done(self, store: ObjectStore) -> int | None:
        """The newest version evaluated before (a resumed run goes on from there)."""
        return latest_metric_step(store, ONLINE_EVAL_STAGE)

    async def run(
        self, generator: TurnGenerator, store: ObjectStore, version: int
    ) -> dict[str, float]:
        """Evaluate policy `version` (what the pool serves, held there by the caller) and
        write its metric line; the line."""
        results, per_env = await evaluate_envs(
            self.config,
            self.entries,
            generator,
            self.decode,
            num_examples=self.config.interval_examples,
        )
        served = {row["policy_version"] for row in results} - {None}
        if served != {version}:
            raise RuntimeError(
                f"online evaluation of policy version {version} was answered by versions "
                f"{sorted(served)}: the pool changed policy during it"
            )
        summary = summary_document("online", version, self.config.rollouts_per_example, per_env)
        line = flat_numbers(summary)
        await asyncio.to_thread(write_metrics, store, ONLINE_EVAL_STAGE, version, line)
        shown = {k.removeprefix(PREFIX): round(v, 4) for k, v in line.items() if k.count("/") == 1}
        logger.info("online eval of policy version %d: %s", version, shown)
        return line
