"""LoRA RL against a real vLLM CPU server with runtime LoRA: only adapters are trained,
published and checkpointed; the pool loads each version under a name of its own, without a
pause, and samples from it.

The run starts from an adapter with random B (the untrained tiny model earns no reward on
reverse-text, so RL alone would leave B at 0, the base): then a server that sampled from the
base instead of the adapter a rollout names would show in the trainer's `mismatch_kl`. The test
starts its own LoRA-enabled server (the session's shared one serves whole models).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from engine.config import PrimeflowConfig
from engine.config.orchestrator import EnvConfig
from engine.config.trainer import LoraConfig
from engine.inference.pool import InferencePool
from engine.run import open_run
from engine.stages import run_rl
from storage.commit import committed_steps, read_commit
from storage.layout import RunLayout
from storage.metrics import read_metrics
from storage.shards import read_rollouts
from tests.integration.adapters import random_adapter
from tests.integration.orchestrator.conftest import make_config, tiny_model  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
STEPS = 3
ADAPTER_FILES = {"adapter_config.json", "adapter_model.safetensors"}


def first_token_logprob(pool: InferencePool, model: str) -> float:
    """The greedy first token's log-prob for one fixed prompt, as the server computes it."""
    endpoint = pool.endpoints[0]
    body = {"model": model, "prompt": "reverse: abcdef", "max_tokens": 1, "temperature": 0.0}
    response = httpx.post(
        f"{endpoint.base_url}/v1/completions",
        json={**body, "logprobs": 1},
        headers={"Authorization": f"Bearer {pool.api_key}"},
        timeout=60,
    )
    response.raise_for_status()
    return response.json()["choices"][0]["logprobs"]["token_logprobs"][0]


def test_lora_rl_trains_publishes_and_serves_adapters_only(
    make_config: Callable[..., PrimeflowConfig],  # noqa: F811
    tiny_model: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    lora = LoraConfig(rank=8, alpha=16.0)
    start = random_adapter(tiny_model, lora, tmp_path / "start")
    config = make_config(
        max_steps=STEPS,
        trainer={
            "lora": lora.model_dump(),
            "init_checkpoint": start,
            "optim": {"lr": 2e-2},
            "checkpoint": {"interval": 2, "keep_last": None},
            "policy": {"keep_last": None},
            "num_threads": 1,
            "rollout_timeout_s": 300.0,
        },
        orchestrator={
            "envs": [EnvConfig(id="reverse-text", args={"num_train_examples": 64})],
            "max_async_level": 1,
            "max_concurrent": 4,
        },
        inference={
            "dtype": "float32",
            "kv_cache_gb": 0.25,
            "extra_args": ["-O0"],
            "verify_reloads": True,  # every server lists each version's folder as loaded
        },
    )
    assert config.inference.lora is not None and config.inference.lora.max_rank == 8
    run = open_run(config)
    with InferencePool.for_run(config, run.logs) as pool:
        pool.reload(start, version=0)  # as the `rl` flow does with trainer.init_checkpoint
        result = run_rl(config, run, pool)
        served = pool.endpoints[0].model
        tuned, base = (first_token_logprob(pool, name) for name in (served, pool.model_name))
    assert result.checkpoint_step == STEPS
    store = run.store

    # Every policy version and resume checkpoint is an adapter folder: the base is never
    # written. Version 0 is the adapter the run started from.
    versions = committed_steps(store, RunLayout.POLICIES)
    assert versions == list(range(STEPS + 1))
    sizes = []
    for step in versions:
        record = read_commit(store, RunLayout.policy_dir(step))
        assert set(record.files) == ADAPTER_FILES and record.meta["adapter"] is True
        sizes.append(record.files["adapter_model.safetensors"].size)
    for step in committed_steps(store, RunLayout.CHECKPOINTS):
        files = set(read_commit(store, RunLayout.checkpoint_dir(step)).files)
        assert files >= ADAPTER_FILES and "config.json" not in files
        assert not any(name.startswith("model") for name in files)

    # The pool swapped adapters in: the last batches were sampled from trained versions, the
    # server names the newest one, and it serves other log-probs than the base.
    lines = read_metrics(store, "orchestrator")
    sampled = {
        v
        for step in range(1, STEPS + 1)
        for v in read_rollouts(store, step).column("policy_version").to_pylist()
    }
    assert max(sampled) >= 1, sampled  # later batches came from versions the trainer made
    assert served.startswith(f"{pool.model_name}@v"), served
    assert abs(tuned - base) > 1e-4, (tuned, base)
    # The trainer's log-probs of the sampled tokens match the server's: every batch was sampled
    # from the adapter its version names (a batch the base served would be far off).
    trainer = read_metrics(store, "rl")
    kls = [line["mismatch_kl"] for line in trainer]
    assert all(kl < 1e-3 for kl in kls), kls
    reloads = [line["time/reload_s"] for line in lines if line.get("time/reload_s")]
    print(f"adapter bytes per version: {sizes}; adapter swap seconds: {reloads}")
