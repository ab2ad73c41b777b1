"""The RL loop of one rank: for each step n (1-based; the base model is policy version 0) wait
for the committed `rollouts/step_n`, pack and train on them, publish `policies/step_n` (the
weights of policy version n, in the background: `engine.trainer.publish`), and commit the resume
checkpoint `checkpoints/step_n` every `checkpoint.interval` steps and at the last step.

Every rank reads the whole step and computes the same packing and rank assignment, so the
ranks agree on the step's loss-token count without a collective.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import pyarrow as pa

from engine.config import PrimeflowConfig
from engine.run import rl_start
from engine.run import run_store as open_store
from engine.trainer.build import StageStart, Trainer, build_trainer, rl_plan
from engine.trainer.distributed import DistInfo, agree_sums
from engine.trainer.loss import LossFn, build_loss, loss_normalization, sequence_weights
from engine.trainer.publish import AdapterPublisher, PolicyPublisher
from engine.trainer.rollouts import no_rollouts_error, samples_from_rollouts
from storage.commit import is_committed
from storage.layout import RunLayout
from storage.shards import read_rollouts

#: How often a trainer waiting for rollouts looks whether a reader discarded its newest
#: policy version (one marker read on rank 0).
REPAIR_CHECK_S = 1.0
log = logging.getLogger("primeflow.trainer")


def run_rl(config: PrimeflowConfig, dist: DistInfo, assets: dict[str, bytes]) -> None:
    """RL: one optimizer step per committed rollout step, up to `trainer.max_steps`."""
    trainer_config = config.trainer
    trainer = build_trainer(
        config,
        "rl",
        dist,
        assets,
        rl_plan(trainer_config),
        StageStart(rl_start(config, open_store(config)), trainer_config.lora),
    )
    loss_fn = build_loss(trainer_config.loss)
    first, _ = trainer.resume()
    publisher = start_publishing(trainer, first - 1)
    try:
        train_rl_steps(trainer, publisher, first, loss_fn)
        publisher.flush()
        trainer.checkpoints.flush()
    finally:
        publisher.close()
        trainer.checkpoints.close()


def train_rl_steps(
    trainer: Trainer, publisher: PolicyPublisher, first: int, loss_fn: LossFn
) -> None:
    """Steps `first` .. max_steps: wait for the rollouts, train, publish, checkpoint when due."""
    for step in range(first, trainer.max_steps + 1):
        wait_start = time.perf_counter()
        table = await_rollouts(trainer, publisher, step)
        train_rl_step(trainer, publisher, loss_fn, step, table, time.perf_counter() - wait_start)


def await_rollouts(trainer: Trainer, publisher: PolicyPublisher, step: int) -> pa.Table:
    """Step `step`'s committed rollouts, read and verified once every rank sees them.

    Meanwhile the newest policy version is published again if a reader discarded it
    (`PolicyPublisher.repair`, every `REPAIR_CHECK_S`): the orchestrator may be waiting for
    exactly that version. The ranks poll in lockstep (one small all-reduce a poll), so they
    agree on when to repair, which is collective, and on when to go on.
    """
    config = trainer.config
    deadline = time.monotonic() + config.rollout_timeout_s
    repair_every = max(1, round(REPAIR_CHECK_S / config.poll_interval_s))
    polls = 0
    while True:
        seen = is_committed(trainer.store, RunLayout.rollouts_dir(step))
        if agree_sums([int(seen)], trainer.dist)[0] == trainer.dist.world_size:
            return read_rollouts(trainer.store, step)
        polls += 1
        if polls % repair_every == 0:
            publisher.repair()
        if time.monotonic() > deadline:
            raise no_rollouts_error(trainer.store, step, config.rollout_timeout_s)
        time.sleep(config.poll_interval_s)


def train_rl_step(
    trainer: Trainer,
    publisher: PolicyPublisher,
    loss_fn: LossFn,
    step: int,
    table: pa.Table,
    wait_seconds: float,
) -> None:
    """Train on step `step`'s committed rollouts `table`, publish the policy, checkpoint when
    due, log the step's metrics."""
    trainer_config = trainer.config
    samples = samples_from_rollouts(
        table,
        step=step,
        vocab_size=trainer.ctx.policy.config.vocab_size,
        seq_len=trainer.seq_len,
        allow_truncation=trainer_config.truncate,
    )
    if loss_normalization(trainer_config.loss) == "sequence":
        weights = sequence_weights([int(s.loss_mask[1:].sum()) for s in samples])
        samples = [replace(s, weight=w) for s, w in zip(samples, weights, strict=True)]
    metrics = trainer.step(samples, loss_fn)
    metrics.update(publisher.publish(step))
    versions = table.column("policy_version").to_pylist()
    metrics.update(
        samples=len(samples),
        wait_seconds=wait_seconds,
        policy_lag_max=max((step - 1 - v for v in versions), default=0),
    )
    trainer.finish_step(step, metrics, {"rollout_step": step})


def start_publishing(trainer: Trainer, resumed_at: int) -> PolicyPublisher:
    """The run's publisher, its lineage starting at the policy the trainer resumed from
    (`PolicyPublisher.start`: versions past it deleted, it published unless committed)."""
    publishing = PolicyPublisher if trainer.ctx.policy.lora is None else AdapterPublisher
    publisher = publishing(
        trainer.store,
        trainer.ctx.policy,
        trainer.optimizer,
        trainer.dist,
        config=trainer.config.policy,
        files=trainer.assets,
        lineage=resumed_at,
    )
    forgotten = publisher.start(resumed_at)
    if forgotten:
        log.info("deleted policy versions %s of the previous lineage", forgotten)
    log.info("policy lineage %s starts at version %d", publisher.lineage_id, resumed_at)
    return publisher
