"""LoRA RL against a real vLLM CPU server with runtime LoRA: only adapters are trained,
published and checkpointed; the pool loads each version under a name of its own, without a
pause, and samples from it, on the base the adapter was trained on.

The run starts from an adapter with random B (the untrained tiny model earns no reward on
reverse-text, so RL alone would leave B at 0, the base): then a server that sampled from the
base instead of the adapter a rollout names would show in the trainer's `mismatch_kl`. The
module starts its own LoRA-enabled server (the session's shared one serves whole models).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from engine.config import PrimeflowConfig
from engine.config.orchestrator import EnvConfig
from engine.config.trainer import LoraConfig
from engine.inference.control import ReloadError
from engine.inference.pool import InferencePool
from engine.run import open_run
from engine.stages import run_rl
from storage.checkpoints import write_checkpoint
from storage.commit import committed_steps, read_commit
from storage.layout import RunLayout
from storage.metrics import read_metrics
from storage.shards import read_rollouts
from storage.store import ObjectStore
from tests.integration.adapters import random_adapter
from tests.integration.orchestrator.conftest import SEQ_LEN, tiny_model  # noqa: F401
from tests.integration.vllm import Weights

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
STEPS = 3
ADAPTER_FILES = {"adapter_config.json", "adapter_model.safetensors"}
LORA = LoraConfig(rank=8, alpha=16.0)
#: fp32 on CPU, as transformers computes; bf16 where vLLM runs on a GPU (its LoRA kernels).
SERVED_DTYPE = "bfloat16" if torch.cuda.is_available() else "float32"
#: The trainer's and the server's log-probs of the same tokens agree to this (fp32 or bf16).
MISMATCH_KL = 1e-2 if SERVED_DTYPE == "bfloat16" else 1e-3


def lora_run(
    model: Path, root: Path, trainer: dict[str, object] | None = None, **sections: object
) -> PrimeflowConfig:
    """A small LoRA RL config on the tiny model; its inference section is the module pool's."""
    return PrimeflowConfig.model_validate(
        {
            "run": {"name": "it"},
            "model": {"name": str(model)},
            "storage": {"uri": f"file://{root}/runs"},
            "seq_len": SEQ_LEN,
            "trainer": {"lora": LORA.model_dump(), **(trainer or {})},
            "inference": {
                "dtype": SERVED_DTYPE,
                "kv_cache_gb": 0.25,
                "extra_args": ["-O0"],
                "verify_reloads": True,  # every server lists each version's folder as loaded
            },
            **sections,
        }
    )


@pytest.fixture(scope="module")
def lora_pool(
    tiny_model: Path,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[InferencePool]:
    """One server with runtime LoRA for the module, as a LoRA run's config starts it."""
    root = tmp_path_factory.mktemp("lora-pool")
    with InferencePool.for_run(lora_run(tiny_model, root), root / "logs") as pool:
        yield pool


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
    lora_pool: InferencePool,
    tiny_model: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    start = random_adapter(tiny_model, LORA, tmp_path / "start")
    config = lora_run(
        tiny_model,
        tmp_path,
        max_steps=STEPS,
        trainer={
            "init_checkpoint": start,
            "optim": {"lr": 2e-2},
            "checkpoint": {"interval": 2, "keep_last": None},
            "policy": {"keep_last": None},
            "num_threads": 1,
            "rollout_timeout_s": 300.0,
        },
        orchestrator={
            "envs": [EnvConfig(id="reverse-text", args={"num_train_examples": 64})],
            "batch_size": 8,
            "rollouts_per_example": 4,
            "max_concurrent": 4,
            "max_async_level": 1,
            "sampling": {"temperature": 1.0, "max_tokens": 24},
            "poll_interval_s": 0.1,
            "policy_timeout_s": 120.0,
        },
    )
    assert config.inference == lora_pool.config
    assert config.inference.lora is not None and config.inference.lora.max_rank == 8
    run = open_run(config)
    pool = lora_pool
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
    assert all(kl < MISMATCH_KL for kl in kls), kls
    reloads = [line["time/reload_s"] for line in lines if line.get("time/reload_s")]
    print(f"adapter bytes per version: {sizes}; adapter swap seconds: {reloads}")


def test_an_adapter_is_served_on_the_base_it_was_trained_on(
    lora_pool: InferencePool, weights: Weights, tmp_path: Path
) -> None:
    """A LoRA RL run on a full-weight SFT's result names that checkpoint as its adapters'
    base: a pool that serves another base (a fresh pool evaluating such a run) brings it in
    before the adapter, and goes back to its model for an adapter of the model."""
    sft = ObjectStore(f"file://{tmp_path}/sft")
    folder = weights.other  # the "SFT result": the tiny model's shapes, other weights
    write_checkpoint(
        sft,
        300,
        weights=load_file(folder / "model.safetensors"),
        config=json.loads((folder / "config.json").read_text()),
    )
    base = sft.url(RunLayout.checkpoint_dir(300))
    on_sft = random_adapter(weights.base, LORA, tmp_path / "on-sft", base=base)
    on_model = random_adapter(weights.base, LORA, tmp_path / "on-model", seed=1)

    assert lora_pool.reload(on_sft, version=7) == 7
    (report,) = lora_pool.compare_served(base)
    assert report["compared"] > 0 and report["mismatched"] == 0, report
    assert lora_pool.endpoints[0].model.startswith(f"{lora_pool.model_name}@v7")

    assert lora_pool.reload(on_model, version=8) == 8
    (report,) = lora_pool.compare_served(weights.base)
    assert report["compared"] > 0 and report["mismatched"] == 0, report

    lost = random_adapter(
        weights.base, LORA, tmp_path / "lost", base=f"file://{tmp_path}/gone/step_000001"
    )
    with pytest.raises(ReloadError, match=r"was trained on .*gone"):
        lora_pool.reload(lost, version=9)
    assert lora_pool.policy_version == 8
