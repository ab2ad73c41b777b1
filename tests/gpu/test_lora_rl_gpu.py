"""LoRA RL on one GPU through the real stack: `primeflow rl` with `--trainer.lora.rank 16` on
the same recipe as `test_rl_gpu.py` (Qwen3-0.6B's body built offline, both pools on GPU 0).

Only adapters are published and checkpointed; vLLM serves each version through runtime LoRA
(`--enable-lora`), swapped in without a pause; every reload is checked (`verify_reloads`: each
server lists the version's folder as the adapter it loaded). Prints the bytes per adapter
version and the swap times. Skipped without a GPU or without vLLM.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from storage.commit import committed_steps, read_commit
from storage.layout import RunLayout
from storage.metrics import read_metrics
from storage.shards import read_rollouts
from tests.gpu.test_rl_gpu import run_rl_on_one_gpu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.timeout(900),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
    pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft"),
]
STEPS = 4
ADAPTER_FILES = {"adapter_config.json", "adapter_model.safetensors"}


def test_lora_rl_on_one_gpu_publishes_and_serves_adapters(tmp_path: Path) -> None:
    lora = ["--trainer.lora.rank", "16", "--trainer.lora.alpha", "32"]
    store = run_rl_on_one_gpu(tmp_path, "gpu-lora", STEPS, *lora, "--trainer.optim.lr", "1e-4")
    assert committed_steps(store, RunLayout.ROLLOUTS) == list(range(1, STEPS + 1))
    sizes = []
    for step in committed_steps(store, RunLayout.POLICIES):
        record = read_commit(store, RunLayout.policy_dir(step))
        assert set(record.files) == ADAPTER_FILES and record.meta["dtype"] == "bfloat16"
        sizes.append(record.files["adapter_model.safetensors"].size)
    files = set(read_commit(store, RunLayout.checkpoint_dir(STEPS)).files)
    assert files >= ADAPTER_FILES and not any(name.startswith("model") for name in files)
    versions = {
        v
        for s in range(1, STEPS + 1)
        for v in read_rollouts(store, s).column("policy_version").to_pylist()
    }
    assert max(versions) >= 1, versions  # the pool swapped trained adapters in
    trainer = read_metrics(store, "rl")
    orchestrator = read_metrics(store, "orchestrator")
    kls = [line["mismatch_kl"] for line in trainer]
    assert all(kl < 1e-2 for kl in kls), kls  # bf16 on both sides; sampled where stamped
    reloads = [line["time/reload_s"] for line in orchestrator if line.get("time/reload_s")]
    steps = [round(line["step_seconds"], 3) for line in trainer]
    print(f"\nadapter bytes per version {sizes}; swap seconds {reloads}; train step s {steps}")
