"""A slow multi-turn environment mixed 1 : 1 with a fast one, against the real vLLM server and
a stand-in trainer that publishes a policy version after every step.

The slow environment's rollouts span several policy versions. They must neither starve (each
environment's trained share within 1.5x of its ratio), nor be thrown away as stale (at most
10 % of the sampled tokens at `max_async_level = 1`), nor be trained in fragments (every
rollout's rows together, checked from the shards by rollout id).
"""

from __future__ import annotations

import json
import threading
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file

from engine.config import PrimeflowConfig
from engine.config.orchestrator import EnvConfig
from engine.inference.pool import InferencePool
from engine.orchestrator.main import run_orchestrator
from engine.run import run_store
from storage.checkpoints import write_checkpoint
from storage.commit import wait_for_step
from storage.layout import RunLayout
from storage.metrics import read_metrics
from storage.shards import read_rollouts

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 10
SLOW = EnvConfig(id="tests.integration.orchestrator.slow_env", name="slow", args={"delay_s": 0.6})
FAST = EnvConfig(id="reverse-text", name="fast", args={"num_train_examples": 64})


def publish_every_step(config: PrimeflowConfig, model: Path, steps: int) -> None:
    """The trainer's part: policy version N once rollouts N are committed (same weights)."""
    store = run_store(config)
    files = {
        name: (model / name).read_bytes()
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
    }
    weights = load_file(model / "model.safetensors")
    model_config = json.loads((model / "config.json").read_text())
    for step in range(1, steps + 1):
        wait_for_step(store, RunLayout.ROLLOUTS, step, timeout_s=300)
        write_checkpoint(
            store, step, weights=weights, config=model_config, files=files,
            parent=RunLayout.POLICIES,
        )  # fmt: skip


@pytest.mark.timeout(600)
def test_a_slow_environment_gets_its_share_whole_and_fresh(
    pool: InferencePool, make_config: Callable[..., PrimeflowConfig], tiny_model: Path
) -> None:
    config = make_config(
        max_steps=STEPS,
        orchestrator={
            "envs": [FAST, SLOW],
            "max_async_level": 1,
            "sampling": {"temperature": 1.0, "max_tokens": 12},
        },
    )
    trainer = threading.Thread(target=publish_every_step, args=(config, tiny_model, STEPS))
    trainer.start()
    assert run_orchestrator(config, pool) == 0
    trainer.join()

    store = run_store(config)
    rows = [row for step in range(1, STEPS + 1) for row in read_rollouts(store, step).to_pylist()]
    trained = Counter(row["env"] for row in rows)
    shares = {env: trained[env] / len(rows) for env in ("fast", "slow")}
    print(f"trained share per environment (requested 0.5 each): {shares}")
    assert all(0.5 / 1.5 <= share <= 0.5 * 1.5 for share in shares.values()), shares

    # Whole rollouts: every rollout id has rows 0..n-1 of its n, all in one step.
    by_rollout: dict[int, list[dict]] = defaultdict(list)
    for row in rows:
        by_rollout[row["rollout_id"]].append(row)
    for rollout, parts in by_rollout.items():
        assert sorted(p["row_index"] for p in parts) == list(range(parts[0]["rollout_rows"]))
        assert len({p["step"] for p in parts}) == 1, rollout

    # The slow rollouts did span several policy versions, and were kept.
    lines = read_metrics(store, "orchestrator")
    versions = {v for row in rows if row["env"] == "slow" for v in row["token_versions"] if v >= 0}
    lags = [row["step"] - 1 - row["policy_version"] for row in rows if row["env"] == "slow"]
    print(f"slow rollouts: versions {sorted(versions)}, lag behind their batch up to {max(lags)}")
    assert max(lags) >= 1, "the slow rollouts never outlived their batch: the test shows nothing"
    stale = {
        env: sum(line.get(f"tokens/{env}/stale", 0) for line in lines)
        / max(1, sum(line.get(f"tokens/{env}/sampled", 0) for line in lines))
        for env in ("fast", "slow")
    }
    print(f"sampled tokens discarded as stale: {stale}")
    assert all(fraction <= 0.10 for fraction in stale.values()), stale
    assert {f"mix/{env}/trained_window" for env in ("fast", "slow")} <= set(lines[-1])
