"""Shared pieces of the trainer integration tests: a tiny GQA model, configs, rollouts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from engine.config import PrimeflowConfig
from engine.run import run_store as open_run_store
from storage.shards import write_rollouts
from tests.unit.trainer.conftest import tiny_model_dir  # noqa: F401  (shared fixture)


def make_config(root: Path, model: Path, name: str, **overrides: Any) -> PrimeflowConfig:
    """A small RL config: seq_len 64, 2-row micro-batches, lr 1e-3 with a linear schedule."""
    trainer = {
        "optim": {"lr": 1e-3},
        "scheduler": {"type": "linear", "warmup_steps": 1, "min_lr_ratio": 0.1},
        "micro_batch_tokens": 128,
        "checkpoint": {"interval": 1, "keep_last": None},
        "rollout_timeout_s": 60.0,
        **overrides.pop("trainer", {}),
    }
    return PrimeflowConfig.model_validate(
        {
            "run": {"name": name, "seed": 0},
            "model": {"name": str(model)},
            "storage": {"uri": f"file://{root}/runs"},
            "seq_len": 64,
            "max_steps": 3,
            "trainer": trainer,
            **overrides,
        }
    )


def rollout_rows(step: int, num: int = 12, vocab: int = 101) -> list[dict[str, Any]]:
    """Deterministic rollouts: prompt tokens unmasked, completion tokens with log-probs."""
    rng = np.random.default_rng(step)
    rows = []
    for i in range(num):
        n = int(rng.integers(8, 60))
        prompt = int(rng.integers(2, n - 2))
        rows.append(
            {
                "step": step,
                "policy_version": step - 1,
                "policy_lineage": "",
                "env": "test",
                "example_id": i // 4,
                "group_id": i // 4,
                "rollout_id": i,
                "row_index": 0,
                "rollout_rows": 1,
                "token_ids": rng.integers(4, vocab, n).tolist(),
                "loss_mask": [False] * prompt + [True] * (n - prompt),
                "logprobs": [0.0] * prompt + (-rng.random(n - prompt) * 5 - 2).tolist(),
                "token_versions": [-1] * prompt + [step - 1] * (n - prompt),
                "reward": float(rng.random()),
                "advantage": float(rng.normal()),
                "temperature": float(rng.choice([0.7, 1.0])),
                "is_truncated": False,
                "prompt_text": "",
                "completion_text": "",
                "metrics": {},
            }
        )
    return rows


def write_steps(config: PrimeflowConfig, steps: range) -> None:
    store = open_run_store(config)
    for step in steps:
        write_rollouts(store, step, rollout_rows(step))
