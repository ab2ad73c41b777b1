"""Entry points: the RL orchestrator and evaluation, from a `PrimeflowConfig`.

Both run against an inference pool: the running one a caller passes (the pipeline keeps one
pool up across stages), or one they start from `config.inference` and stop when done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from engine.config import PrimeflowConfig
from engine.config.orchestrator import EnvConfig, SamplingConfig
from engine.envs import ChatTokenizer, MixEntry, TurnGenerator, load_environment
from engine.inference.client import InferenceClient
from engine.inference.pool import InferencePool
from engine.inference.serving import PolicyServing
from engine.models.tokenizer import load_tokenizer
from engine.orchestrator.evaluate import decoder, evaluate_envs, summary_document
from engine.orchestrator.loop import Orchestrator
from engine.orchestrator.online_eval import OnlineEval
from engine.run import logs_dir, run_store, stage_store
from storage.evals import write_eval
from storage.layout import RunLayout, Stage
from storage.metrics import write_metrics
from storage.store import ObjectStore

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def policy_pool(config: PrimeflowConfig, pool: PolicyServing | None) -> Iterator[PolicyServing]:
    """`pool` when given; else a pool started from `config.inference`, stopped on exit."""
    if pool is not None:
        yield pool
        return
    with InferencePool.for_run(config, logs_dir(config)) as started:
        yield started


def mix_entries(envs: list[EnvConfig], default: SamplingConfig) -> list[MixEntry]:
    return [MixEntry(load_environment(env), env.ratio, env.sampling or default) for env in envs]


def run_orchestrator(
    config: PrimeflowConfig,
    pool: PolicyServing | None = None,
    stop: threading.Event | None = None,
    *,
    store: ObjectStore | None = None,
) -> int:
    """Make and commit `rollouts/step_N` for every remaining RL step; 0 when all are done.

    Setting `stop` (from another thread) ends the loop at its next poll with
    `OrchestratorStoppedError`; a step being committed at that moment is committed first.
    `store` is the run's root (the stage passes the one it opened; None: from the config).
    """
    orchestrator_config = config.orchestrator
    entries = mix_entries(orchestrator_config.envs, orchestrator_config.sampling)
    tokenizer = load_tokenizer(config.orchestrator.model, config.model)
    store = store if store is not None else run_store(config)
    online_eval = None
    if config.eval.interval is not None:
        eval_entries = mix_entries(config.eval.envs, config.eval.sampling)
        online_eval = OnlineEval(config.eval, eval_entries, decoder(tokenizer))
    with policy_pool(config, pool) as serving:

        async def main() -> None:
            async with InferenceClient.from_pool(
                serving, max_concurrent=orchestrator_config.max_concurrent
            ) as client:
                await Orchestrator(
                    orchestrator_config,
                    store=store,
                    sampler=client,
                    server=serving,
                    tokenizer=tokenizer,
                    envs=entries,
                    seed=config.run.seed,
                    stop=stop,
                    online_eval=online_eval,
                ).run()

        asyncio.run(main())
    return 0


@dataclass(frozen=True)
class EvalOutcome:
    """Where an evaluation was committed and its `summary.json` document."""

    uri: str
    summary: dict[str, Any]


def evaluate_policy(
    config: PrimeflowConfig,
    store: ObjectStore,
    pool: PolicyServing,
    *,
    name: str,
    stage: Stage,
    step: int,
) -> EvalOutcome:
    """Evaluate checkpoint `step` of `stage` on the config's eval split, with `pool` (reloaded
    to it unless it serves that version), and commit `eval/<name>/step_<step>` under the run
    root `store`. Which step to take is `engine.stages.eval_step`'s decision."""
    eval_config = config.eval
    entries = mix_entries(eval_config.envs, eval_config.sampling)
    tokenizer = load_tokenizer(config.orchestrator.model, config.model)
    seq_len = config.orchestrator.seq_len
    if step != pool.policy_version:
        uri = stage_store(store, stage).url(RunLayout.checkpoint_dir(step))
        pool.reload(uri, version=step)

    async def main() -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
        async with InferenceClient.from_pool(
            pool, max_concurrent=eval_config.max_concurrent
        ) as client:
            generator = TurnGenerator(client, ChatTokenizer(tokenizer), seq_len)
            return await evaluate_envs(eval_config, entries, generator, decoder(tokenizer))

    results, per_env = asyncio.run(main())
    k = eval_config.rollouts_per_example
    summary = summary_document(name, step, k, per_env)
    uri = write_eval(store, name, step, results, summary)
    flat = {key: value for key, value in summary.items() if isinstance(value, int | float)}
    write_metrics(store, f"eval-{name}", step, flat)
    logger.info("eval %s step %d: %s (%s)", name, step, flat, uri)
    return EvalOutcome(uri=uri, summary=summary)
