"""The RL data plane: rollouts in flight → scored groups → one committed shard set per step.

Rollouts run continuously: whenever a group finishes, another starts, up to `max_concurrent`
rollouts in flight, so a step never waits for the slowest rollout of its batch — a late group
simply lands in a later batch (if it is still fresh enough). Each finished group is scored,
given advantages and admitted to the step being built by `BatchBuilder`, which enforces the
async bound and the filters. New rollouts start only while the policy the pool serves may go
into that step; otherwise the loop waits for the trainer's next policy version, which it asks
the pool to load as soon as it is committed. With `eval.interval` set, the policy served is also
evaluated on held-out tasks every so many versions (`engine.orchestrator.online_eval`; a failed
evaluation is a warning).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.config.orchestrator import OrchestratorConfig
from engine.envs import ChatTokenizer, EnvMix, MixEntry, Rollout, Sampler, Task, TurnGenerator
from engine.inference.control import (
    BrokenVersionError,
    ServedWeightsMismatchError,
    ServerDiedError,
)
from engine.inference.serving import PolicyServing
from engine.orchestrator.advantages import build_advantage_fn
from engine.orchestrator.async_bound import may_sample_for, min_policy_version, newest_batch_for
from engine.orchestrator.batch import BatchBuilder, StepBatch
from engine.orchestrator.filter_watch import FilterWatch, groups_in_a_row_limit
from engine.orchestrator.filters import build_filters
from engine.orchestrator.launch_sizing import LaunchSizer
from engine.orchestrator.online_eval import OnlineEval, is_due
from engine.orchestrator.samples import Group, TrainSample, build_group
from engine.orchestrator.signal_watch import RESUME_WINDOW, SignalWatch
from engine.orchestrator.skips import SkipWatch
from engine.orchestrator.step_metrics import ZERO_GROUP_FRACTION, mix_shares, step_metrics
from storage.commit import latest_committed_step, read_commit
from storage.layout import RunLayout
from storage.metrics import recent_metrics, write_metrics
from storage.policies import committed_version, discard_version
from storage.shards import write_rollouts
from storage.store import ObjectStore

logger = logging.getLogger(__name__)

#: The stage name of the orchestrator's lines under `<run>/metrics/`.
METRICS_STAGE = "orchestrator"
#: Consecutive failed reloads of a committed checkpoint before the run stops.
MAX_RELOAD_FAILURES = 3
#: Steps over which each environment's trained share is measured (and starvation reported).
MIX_WINDOW = 10


class OrchestratorStoppedError(RuntimeError):
    """The caller asked the loop to stop (its stage is giving up, e.g. the trainer died)."""


@dataclass(frozen=True)
class _Launch:
    index: int
    entry: MixEntry
    task: Task
    group_id: int


class Orchestrator:
    """Drives environments against the pool and commits `rollouts/step_N` for N = 1..max_steps."""

    def __init__(
        self,
        config: OrchestratorConfig,
        *,
        store: ObjectStore,
        sampler: Sampler,
        server: PolicyServing,
        tokenizer: Any,
        envs: Sequence[MixEntry],
        seed: int = 0,
        stop: threading.Event | None = None,
        online_eval: OnlineEval | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.server = server
        self.tokenizer = tokenizer
        self.generator = TurnGenerator(sampler, ChatTokenizer(tokenizer), config.seq_len)
        self.mix = EnvMix(envs, seed=seed)
        #: Per environment: groups admitted to a batch or still on their way (in flight or
        #: waiting for the next batch); draws follow the mix ratios over these.
        self._landed = [0] * len(envs)
        self._trained_window: deque[dict[str, int]] = deque(maxlen=MIX_WINDOW)
        self.advantage_fn = build_advantage_fn(config.advantage, config.sampling.max_tokens)
        self.filters = build_filters(config.filters)
        self.skips = SkipWatch()
        groups_per_batch = (
            config.batch_size / config.rollouts_per_example if config.batch_unit == "samples" else 1
        )
        self.filtered = FilterWatch(
            [f.name for f in self.filters], groups_in_a_row_limit(groups_per_batch)
        )
        self.signal = SignalWatch(config.max_steps_without_signal)
        self.metrics: list[dict[str, float]] = []
        self._inflight: dict[asyncio.Task[list[Rollout]], _Launch] = {}
        self._pending: deque[tuple[int, Group]] = deque()
        #: What recent batches' groups gave them: sizes the launches.
        self._sizer = LaunchSizer(
            group_size=config.rollouts_per_example,
            unit=config.batch_unit,
            margin_sd=config.launch_margin_sd,
        )
        self._group_ids = itertools.count()
        self._last_poll = -math.inf
        self._reload_failures = 0
        #: The load of a newer policy version into the pool, while one runs.
        self._reload: asyncio.Task[None] | None = None
        #: The uid of the policy version this loop last had the pool load (None: none yet).
        self._served_uid: str | None = None
        self.online_eval = online_eval
        #: The held-out evaluation of the served policy, while one runs (no reload meanwhile).
        self._evaluation: asyncio.Task[dict[str, float]] | None = None
        self._last_evaluated = online_eval.last_done(store) if online_eval else None
        # Seconds of the step being built: reloads that ended in it (and their phases, as the
        # pool measures them), blocked on the policy.
        self._timing = {"time/reload_s": 0.0, "time/policy_wait_s": 0.0}
        # Set by a supervising thread: without it a loop whose trainer died would keep sampling
        # (and later committing) beside the stage's retry, two writers of the same steps.
        self._stop = stop or threading.Event()

    # -- the loop ---------------------------------------------------------------------------

    async def run(self) -> list[dict[str, float]]:
        """Commit every remaining step (resuming after the last committed one); its metrics."""
        first = self._resume()
        try:
            for step in range(first, self.config.max_steps + 1):
                started = time.monotonic()
                self._timing = dict.fromkeys(self._timing, 0.0)
                batch = await self._collect(step)
                await self._commit(step, batch, time.monotonic() - started)
                self._sizer.closed(batch)
            if self._reload is not None:
                await self._reload  # a policy that failed verification fails the run
            if self._evaluation is not None:
                await asyncio.wait({self._evaluation})
                self._end_evaluation()
        finally:
            await self._cancel_inflight()
        return self.metrics

    def _resume(self) -> int:
        """The first step to make; after a restart, the task order continues where it was."""
        last = latest_committed_step(self.store, RunLayout.ROLLOUTS)
        if last is None:
            return 1
        meta = read_commit(self.store, RunLayout.rollouts_dir(last)).meta
        draws = meta.get("draws")
        if isinstance(draws, list) and len(draws) == len(self.mix.entries):
            self.mix.skip([int(count) for count in draws])
        else:  # written when draws followed the ratios alone: replay them
            for _ in range(int(meta.get("groups", 0))):
                self.mix.next()
        drawn = sum(self.mix.counts)
        self._group_ids = itertools.count(drawn)  # group (and rollout) ids stay unique
        lines = recent_metrics(self.store, METRICS_STAGE, RESUME_WINDOW)
        self.signal.replay([line for line in lines if line["step"] <= last])
        logger.info("resuming after committed rollouts step %d (%d groups drawn)", last, drawn)
        return last + 1

    async def _collect(self, step: int) -> StepBatch:
        builder = BatchBuilder(
            step,
            batch_size=self.config.batch_size,
            unit=self.config.batch_unit,
            filters=self.filters,
            max_async_level=self.config.max_async_level,
            max_off_policy_steps=self.config.max_off_policy_steps,
        )
        blocked_since: float | None = None
        while True:
            self._check_stop(step)
            await self._refresh_policy()
            served = self.server.policy_version
            while self._pending and not builder.full:
                index, group = self._pending.popleft()
                admission = builder.add(group)
                if admission == "admitted":
                    self.filtered.admitted()
                else:
                    self._landed[index] -= 1  # it will not train: draw its environment again
                if admission == "filtered":
                    self.filtered.dropped(group)  # filters that drop every group fail here
            if builder.full:
                return builder.batch
            if may_sample_for(step, served, self.config.max_async_level):
                self._top_up(builder, served)
            if not self._inflight:
                blocked_since = blocked_since or time.monotonic()
                self._check_wait(step, served, time.monotonic() - blocked_since)
                waited = time.monotonic()
                await self._wait_for(set())
                self._timing["time/policy_wait_s"] += time.monotonic() - waited
                continue
            blocked_since = None
            for task in await self._wait_for(set(self._inflight)):
                if task in self._inflight:
                    index, group = self._finish(task)
                    self.skips.record(group)  # an environment that only skips fails here
                    self._pending.append((index, group))

    async def _wait_for(self, tasks: set[asyncio.Task[Any]]) -> set[asyncio.Task[Any]]:
        """Wait up to a poll interval for one of `tasks` or the running reload to end; the
        ones that ended (a finished reload wakes the loop to sample on the new version)."""
        tasks = {*tasks, *(t for t in (self._reload, self._evaluation) if t is not None)}
        if not tasks:
            await asyncio.sleep(self.config.poll_interval_s)
            return set()
        done, _ = await asyncio.wait(
            tasks, timeout=self.config.poll_interval_s, return_when=asyncio.FIRST_COMPLETED
        )
        return done

    def _check_stop(self, step: int) -> None:
        if self._stop.is_set():
            raise OrchestratorStoppedError(f"stopped while collecting rollouts for step {step}")

    def _check_wait(self, step: int, served: int, waited_s: float) -> None:
        if waited_s <= self.config.policy_timeout_s:
            return
        needed = min_policy_version(step, self.config.max_async_level)
        raise TimeoutError(
            f"step {step} needs policy version {needed} but the pool serves {served} and no "
            f"newer version was committed under {self.store.url(RunLayout.POLICIES)} in "
            f"{waited_s:.0f} s (orchestrator.policy_timeout_s); is the trainer running?"
        )

    def _top_up(self, builder: BatchBuilder, served: int) -> None:
        """Start groups until `max_concurrent` rollouts are in flight (at least one group), but
        no more than the batches that rollouts started on the `served` version may go into
        still lack (`newest_batch_for`): on-policy only this batch, async up to
        `max_async_level` more. A surplus would land in later batches, further behind than the
        bound (or, on-policy, be thrown away as stale). What they lack is counted in groups at
        what recent groups gave, with a margin for the filters' drops (`LaunchSizer`).
        """
        per_group = self.config.rollouts_per_example
        later = max(0, newest_batch_for(served, self.config.max_async_level) - builder.batch.step)
        wanted = self._sizer.groups_wanted(builder, later)
        while not self._inflight or (
            (len(self._inflight) + 1) * per_group <= self.config.max_concurrent
            and len(self._inflight) < wanted
        ):
            index, entry, task = self.mix.next(self._landed)
            self._landed[index] += 1
            coroutine = entry.env.run_group(task, per_group, self.generator, entry.sampling)
            launched = asyncio.create_task(coroutine)
            self._inflight[launched] = _Launch(index, entry, task, next(self._group_ids))

    def _finish(self, task: asyncio.Task[list[Rollout]]) -> tuple[int, Group]:
        launch = self._inflight.pop(task)
        group = build_group(
            task.result(),  # failures of the pool itself propagate and stop the run
            group_id=launch.group_id,
            temperature=launch.entry.sampling.temperature,
            advantage_fn=self.advantage_fn,
            truncated_reward=self.config.truncated_reward,
        )
        return launch.index, group

    async def _cancel_inflight(self) -> None:
        tasks = list(self._inflight)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._inflight.clear()
        if self._reload is not None:  # a thread cannot be cancelled: let it end
            await asyncio.gather(self._reload, return_exceptions=True)
            self._reload = None
        if self._evaluation is not None:
            self._evaluation.cancel()
            await asyncio.gather(self._evaluation, return_exceptions=True)
            self._evaluation = None

    # -- policy -----------------------------------------------------------------------------

    async def _refresh_policy(self) -> None:
        """Start loading the newest committed policy version when the pool serves another,
        and go on sampling while it loads.

        Normally that is a newer one. After the trainer resumed from an older checkpoint, the
        versions it had published past that checkpoint are gone (`engine.trainer.publish`) and
        the newest is older than what the pool serves: the pool goes back to it, so it never
        serves a policy of the dead lineage longer than one poll. A version it publishes again
        under a number the pool serves has another uid, and is loaded too.

        The load runs beside the loop: requests sent meanwhile name the version served when
        they were sent (the pool reports a new version only once every server has it), so
        a swap that takes a second no longer stops the loop from sending and collecting.

        A held-out evaluation due on the version served starts first, and no newer version is
        loaded until it ends.
        """
        if self._evaluation is not None:
            if not self._evaluation.done():
                return
            self._end_evaluation()
        if self._reload is not None:
            if not self._reload.done():
                return
            finished, self._reload = self._reload, None
            finished.result()  # raises what must stop the run
        if self._start_evaluation():
            return
        now = time.monotonic()
        if now - self._last_poll < self.config.poll_interval_s:
            return
        self._last_poll = now
        latest = await asyncio.to_thread(self._newest_policy)
        if latest is None or latest == (self.server.policy_version, self._served_uid):
            return
        self._reload = asyncio.create_task(self._load_policy(*latest))

    def _newest_policy(self) -> tuple[int, str | None] | None:
        """The newest committed policy version and its uid; None when there is none, or when
        it was deleted as it was read (a resumed trainer rolling back). The uid tells a
        version that a resumed trainer published again from the one served under its number."""
        step = latest_committed_step(self.store, RunLayout.POLICIES)
        version = None if step is None else committed_version(self.store, step)
        return None if version is None else (version.step, version.uid)

    def _end_evaluation(self) -> None:
        """Forget the finished evaluation; a failure is a warning, as any reporting's is (a
        dead pool fails the rollouts anyway)."""
        assert self._evaluation is not None
        evaluated, self._evaluation = self._evaluation, None
        if (failure := evaluated.exception()) is not None:
            logger.warning("online evaluation failed: %s: %s", type(failure).__name__, failure)

    def _start_evaluation(self) -> bool:
        """Start evaluating the served policy when it is due; whether one started."""
        served = self.server.policy_version
        if self.online_eval is None or not is_due(
            served, self._last_evaluated, self.online_eval.interval
        ):
            return False
        self._last_evaluated = served
        self._evaluation = asyncio.create_task(
            self.online_eval.run(self.generator, self.store, served)
        )
        return True

    async def _load_policy(self, version: int, uid: str | None) -> None:
        """Load policy `version` (the write named `uid`) into the pool; a failure is retried
        at the next poll, up to `MAX_RELOAD_FAILURES` in a row, and a served-weights mismatch
        or a dead server stops the run at once.

        A version whose files or chain do not verify is discarded instead: no reload of it
        could succeed, and a run that stopped on it would fail the same way on every retry.
        The pool goes on serving what it holds, the next poll takes the newest version left,
        and the trainer, finding its newest version gone, publishes it again in full
        (`engine.trainer.publish.PolicyPublisher.repair`).
        """
        uri = self.store.url(RunLayout.policy_dir(version))
        started = time.monotonic()
        try:
            await asyncio.to_thread(self.server.reload, uri, version)
        except (ServedWeightsMismatchError, ServerDiedError):
            raise
        except BrokenVersionError as exc:
            discarded = await asyncio.to_thread(discard_version, self.store, version, uid)
            logger.warning(
                "policy version %d cannot be served, %s: %s; the pool keeps policy version %d",
                version,
                "discarded it for the trainer to publish again" if discarded else "replaced since",
                exc,
                self.server.policy_version,
            )
            self._last_poll = -math.inf
            return
        except Exception as exc:
            self._reload_failures += 1
            logger.warning("reload of %s failed (%d): %s", uri, self._reload_failures, exc)
            if self._reload_failures >= MAX_RELOAD_FAILURES:
                raise
            return
        finally:
            self._timing["time/reload_s"] += time.monotonic() - started
        self._reload_failures = 0
        self._served_uid = uid
        for phase, seconds in self.server.last_swap.items():
            key = f"time/reload_{phase}_s"
            self._timing[key] = self._timing.get(key, 0.0) + seconds
        logger.info("the pool serves policy version %d (%s)", version, uri)

    # -- output -----------------------------------------------------------------------------

    def _mix_metrics(self, step: int, batch: StepBatch) -> dict[str, float]:
        """Requested against trained share per environment, this step and over the last
        `MIX_WINDOW` steps; a warning when an environment trained nothing in a whole window."""
        trained = {entry.env.name: 0 for entry in self.mix.entries}
        for sample in batch.samples:
            trained[sample.env] += 1
        self._trained_window.append(trained)
        window = {env: sum(counts[env] for counts in self._trained_window) for env in trained}
        ratios = dict(zip(trained, self.mix.ratios, strict=True))
        metrics = mix_shares(ratios, trained, window)
        starved = [env for env, count in window.items() if count == 0]
        if starved and len(self._trained_window) == MIX_WINDOW and step % MIX_WINDOW == 0:
            logger.warning(
                "no sample of %s was trained in the last %d steps: its groups are too slow for "
                "max_off_policy_steps (%d), fail, or are filtered out",
                ", ".join(starved),
                MIX_WINDOW,
                self.config.max_off_policy_steps,
            )
        return metrics

    def _row(self, step: int, sample: TrainSample) -> dict[str, Any]:
        sequence = sample.sequence
        prompt, completion = (
            sequence.token_ids[: sequence.prompt_len],
            sequence.token_ids[sequence.prompt_len :],
        )
        return {
            "step": step,
            "policy_version": sample.policy_version,
            "policy_lineage": sample.policy_lineage,
            "env": sample.env,
            "example_id": sample.example_id,
            "group_id": sample.group_id,
            "rollout_id": sample.rollout_id,
            "row_index": sample.row_index,
            "rollout_rows": sample.rollout_rows,
            "token_ids": sequence.token_ids,
            "loss_mask": sequence.loss_mask,
            "logprobs": sequence.logprobs,
            "token_versions": sequence.token_versions,
            "reward": sample.reward,
            "advantage": sample.advantage,
            "temperature": sample.temperature,
            "is_truncated": sample.is_truncated,
            "prompt_text": self.tokenizer.decode(prompt, skip_special_tokens=False),
            "completion_text": self.tokenizer.decode(completion, skip_special_tokens=False),
            "metrics": {k: float(v) for k, v in sample.metrics.items() if math.isfinite(v)},
        }

    async def _commit(self, step: int, batch: StepBatch, elapsed_s: float) -> None:
        """Write the step's metric line, then commit its rollouts.

        In that order, so a fault between the two (the run root turning read-only, a kill)
        leaves a metric line for a step that is redone, and overwritten, on resume; the other
        order left a committed step without its line, which a resumed run never writes.
        """
        served = self.server.policy_version
        rows = [self._row(step, sample) for sample in batch.samples]
        meta = {
            "groups": sum(self.mix.counts),
            "draws": list(self.mix.counts),
            "served_version": served,
        }
        metrics = {
            **step_metrics(batch, served_version=served, elapsed_s=elapsed_s),
            **self._mix_metrics(step, batch),
            **self._timing,
            "policy/verified_tensors": self.server.verified_tensors,
        }
        self.skips.say()
        await asyncio.to_thread(write_metrics, self.store, METRICS_STAGE, step, metrics)
        await asyncio.to_thread(write_rollouts, self.store, step, rows, meta=meta)
        self.metrics.append({"step": step, **metrics})
        logger.info(
            "step %d: %d samples, reward %.3f, %.1f samples/s, policy %d (oldest %d)",
            step,
            metrics["samples"],
            metrics["reward/mean"],
            metrics["throughput/samples_per_s"],
            served,
            metrics["policy/oldest_version"],
        )
        # After the commit: the steps up to a collapse stay, for a look at what the policy did
        self.signal.record(step, metrics[ZERO_GROUP_FRACTION], metrics["reward/mean"])
