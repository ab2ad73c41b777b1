"""Evaluation against a real vLLM CPU server: avg@k and pass@k, committed with every sample."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import pyarrow.ipc as ipc
import pytest

from engine.config import PrimeflowConfig
from engine.inference.pool import InferencePool
from engine.orchestrator.main import evaluate_policy
from engine.run import run_store
from storage.commit import read_commit, read_verified
from storage.evals import RESULTS, SUMMARY
from storage.layout import RunLayout
from storage.paths import join

pytestmark = pytest.mark.integration


def test_eval_reports_avg_and_pass_at_k_with_per_sample_results(
    pool: InferencePool, make_config: Callable[..., PrimeflowConfig]
) -> None:
    config = make_config(
        eval={
            "envs": [{"id": "reverse-text", "args": {"num_eval_examples": 8}}],
            "num_examples": 6,
            "rollouts_per_example": 3,
            "sampling": {"max_tokens": 24},
            "pass_threshold": 0.1,
        }
    )
    store = run_store(config)
    outcome = evaluate_policy(config, store, pool, name="base", stage="rl", step=0)

    step_dir = RunLayout.eval_dir("base", 0)
    record = read_commit(store, step_dir)
    assert set(record.files) == {RESULTS, SUMMARY} and record.rows == 6 * 3 + 6
    summary = json.loads(read_verified(store, join(step_dir, SUMMARY), record.files[SUMMARY]))
    assert summary == outcome.summary and outcome.uri == store.url(step_dir)
    table = ipc.open_file(
        read_verified(store, join(step_dir, RESULTS), record.files[RESULTS])
    ).read_all()
    sampled = [row for row in table.to_pylist() if row["mode"] == "sampled"]
    greedy = [row for row in table.to_pylist() if row["mode"] == "greedy"]
    assert len(sampled) == 18 and len(greedy) == 6
    assert {row["temperature"] for row in greedy} == {0.0}

    env = summary["envs"]["reverse-text"]
    rewards = [0.0 if math.isnan(row["reward"]) else row["reward"] for row in sampled]
    assert env["avg@3"] == pytest.approx(sum(rewards) / 18)
    assert summary["avg@3"] == env["avg@3"] and env["samples"] == 18 and env["examples"] == 6
    passes: dict[int, int] = {}
    for row in sampled:
        assert row["passed"] == (row["reward"] >= 0.1)
        passes[row["example_id"]] = passes.get(row["example_id"], 0) + row["passed"]
    assert env["pass@3"] == pytest.approx(sum(c > 0 for c in passes.values()) / 6)
    assert env["pass@1"] == pytest.approx(sum(c / 3 for c in passes.values()) / 6)
    assert env["greedy"]["samples"] == 6
    assert all(row["prompt_text"].startswith("<|im_start|>system\n") for row in sampled)
