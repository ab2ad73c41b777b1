"""The prefect variant of the overhead benchmark: the stand-in's steps wrapped as `rl_loop` is.

A flow, a stage task (no cache, results kept in memory), and the real `StageMonitor` around
the wait for the pool, with the monitor's production settings.
"""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from storage.store import ObjectStore
from tasks.reporting import StageMonitor


@task(name="rl-loop", cache_policy=NO_CACHE, persist_result=False)
def stand_in_stage(root: str, steps: int, step_s: float) -> tuple[float, float]:
    from tests.bench.prefect.bench_prefect import run_stand_in

    store = ObjectStore(root)
    with StageMonitor(store, store.url().rsplit("/", 1)[-1], "rl", total_steps=steps):
        return run_stand_in(root, steps, step_s)


@flow(name="bench-prefect-overhead", persist_result=False)
def overhead_flow(root: str, steps: int, step_s: float) -> tuple[float, float]:
    """(the stand-in's loop seconds, the stage's seconds), as measured inside the task."""
    return stand_in_stage(root, steps, step_s)
