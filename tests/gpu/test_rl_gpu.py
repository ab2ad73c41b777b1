"""Async RL on one GPU through the real stack: `primeflow server start`, then `primeflow rl`.

Both pools share GPU 0 (`configs/qwen3_0_6b/one_gpu.toml`) and serve and train Qwen3-0.6B's
body built offline (`primeflow/qwen3-0.6b-body`: its 28 × 1024 shapes with the character
vocabulary, random weights, no hub). Every reload is verified (`--inference.verify-reloads`): each
server compares the parameters it serves with the committed policy version bit for bit, and a
mismatch fails the run. The async run's server has two API processes. Skipped without a GPU or
without vLLM.

On the H200 with vLLM 0.26 (../shared/gpu-vllm): about 4 minutes, most of it vLLM's start.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from storage.commit import committed_steps, latest_committed_step, read_commit, verify_step
from storage.layout import RunLayout
from storage.metrics import read_metrics
from storage.policies import load_policy_weights
from storage.shards import read_rollouts
from storage.store import ObjectStore

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.timeout(900),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = [ROOT / "configs/qwen3_0_6b/reverse_text.toml", ROOT / "configs/qwen3_0_6b/one_gpu.toml"]
STEPS = 4


def primeflow(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "flows.cli", *args]
    return subprocess.run(
        command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_rl_on_one_gpu(tmp_path: Path, name: str, steps: int, *flags: str) -> ObjectStore:
    """`primeflow rl` on the one-GPU recipe (every reload verified) against a Prefect server
    of its own; the run's root store once it succeeded."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(
        PRIMEFLOW_HOME=str(tmp_path / "home"),
        PRIMEFLOW_CACHE=str(tmp_path / "cache"),
        DO_NOT_TRACK="1",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
    )
    args = [arg for path in CONFIGS for arg in ("@", str(path))]
    args += [
        "--model.name", "primeflow/qwen3-0.6b-body",
        "--run.name", name,
        "--storage.uri", f"file://{tmp_path / 'runs'}",
        "--max-steps", str(steps),
        "--inference.verify-reloads",
        *flags,
    ]  # fmt: skip
    started = primeflow("server", "start", "--port", str(free_port()), env=env, timeout=120)
    assert started.returncode == 0, started.stderr
    try:
        result = primeflow("rl", *args, env=env, timeout=840)
    finally:
        primeflow("server", "stop", env=env, timeout=60)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return ObjectStore(f"file://{tmp_path / 'runs'}/{name}")


def test_async_rl_on_one_gpu_serves_exactly_what_it_commits(tmp_path: Path) -> None:
    # Two API processes in front of the engine (`inference.api_servers`): every verified reload
    # must hold for requests whichever process took them (the CPU check: test_lifecycle.py).
    store = run_rl_on_one_gpu(tmp_path, "gpu-rl", STEPS, "--inference.api-servers", "2")
    # Every RL step committed once, verified against its marker. A group launched within the
    # async bound may land in a later batch (issue 16), its oldest token at most
    # max_off_policy_steps (8) behind; never from a version the trainer had not made yet. Each
    # rollout's version is its oldest sampled token's.
    assert committed_steps(store, RunLayout.ROLLOUTS) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        verify_step(store, RunLayout.rollouts_dir(step))
        table = read_rollouts(store, step)
        versions = table.column("policy_version").to_pylist()
        assert all(step - 1 - 8 <= version <= step - 1 for version in versions), (step, versions)
        tokens_of = table.column("token_versions").to_pylist()
        for version, tokens in zip(versions, tokens_of, strict=True):
            sampled = [token for token in tokens if token >= 0]
            assert not sampled or min(sampled) == version, (step, version, set(sampled))
    assert latest_committed_step(store, RunLayout.CHECKPOINTS) == STEPS
    verify_step(store, RunLayout.checkpoint_dir(STEPS))
    assert committed_steps(store, RunLayout.POLICIES)[-1] == STEPS
    verify_step(store, RunLayout.policy_dir(STEPS))

    trainer = read_metrics(store, "rl")
    orchestrator = read_metrics(store, "orchestrator")
    assert [line["step"] for line in trainer] == list(range(1, STEPS + 1))
    assert all(
        line["peak_memory_gib"] > 0 and "publish_snapshot_seconds" in line for line in trainer
    )
    assert trainer[-1]["checkpoint_seconds"] > 0  # the last step always commits a checkpoint
    # The pool loaded at least the policies the async bound needed, and each was the policy
    # version's exact bits on every served parameter (a mismatch would have failed the run).
    served = [line["policy/served_version"] for line in orchestrator]
    assert served[-1] >= STEPS - 2
    assert orchestrator[-1]["policy/verified_tensors"] > 0
    # Version 0 is full, the later ones exact deltas (the recipe's small lr changes few bf16
    # entries): the server applied them in place on the GPU, each reload verified as above.
    kinds = [
        read_commit(store, RunLayout.policy_dir(step)).meta["kind"]
        for step in committed_steps(store, RunLayout.POLICIES)
    ]
    assert kinds[-1] == "delta", kinds
    # The metric is what changed between the newest two versions, counted from their files
    # (it may be 0: the recipe's tiny lr on an untrained body can leave every bf16 entry as is).
    old, new = (load_policy_weights(store, step) for step in (STEPS - 1, STEPS))
    stored = {id(tensor): name for name, tensor in new.items()}.values()  # a tied head once
    changed = sum(int((old[n].view(torch.int16) != new[n].view(torch.int16)).sum()) for n in stored)
    total = sum(new[name].numel() for name in stored)
    assert trainer[-1]["policy_changed_fraction"] == pytest.approx(changed / total, abs=1e-9)
