"""The torchrun pool: 2 gloo ranks equal 1, and the pool dies with its supervisor."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

from engine.run import run_store as open_run_store
from engine.trainer.pool import run_trainer
from storage.checkpoints import (
    TrainerState,
    fetch_checkpoint,
    load_checkpoint_weights,
    load_trainer_state,
)
from storage.commit import read_commit
from storage.layout import RunLayout
from storage.metrics import read_metrics
from tests.integration.trainer.conftest import make_config, write_steps


def checkpoint(config, step: int) -> tuple[dict[str, torch.Tensor], TrainerState]:
    """A resume checkpoint's weights and trainer state, fetched and verified."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = fetch_checkpoint(
            open_run_store(config), step, Path(tmp) / "ckpt", trainer_state=True
        )
        return load_checkpoint_weights(folder), load_trainer_state(folder)


def test_two_gloo_ranks_take_the_same_steps_as_one(tmp_path: Path, tiny_model_dir: Path) -> None:
    configs = {}
    for nproc in (1, 2):
        config = make_config(
            tmp_path,
            tiny_model_dir,
            f"ranks-{nproc}",
            max_steps=2,
            trainer={"parallel": {"nproc_per_node": nproc, "backend": "gloo"}},
        )
        write_steps(config, range(1, 3))
        assert run_trainer(config, "rl") == 0
        configs[nproc] = config
    one = read_metrics(open_run_store(configs[1]), "rl")
    two = read_metrics(open_run_store(configs[2]), "rl")
    for a, b in zip(one, two, strict=True):
        assert a["loss_tokens"] == b["loss_tokens"] and a["tokens"] == b["tokens"]
        # Same batch, same normalisation; only the order of fp32 sums differs.
        for key in ("loss", "grad_norm", "entropy", "mismatch_kl"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    (w1, s1), (w2, s2) = checkpoint(configs[1], 2), checkpoint(configs[2], 2)
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-5, atol=1e-6, msg=name)
    # Two ranks wrote the checkpoint together, each the whole tensors it owns: every AdamW
    # moment is there once, in full, and both ranks' RNG states.
    files = read_commit(open_run_store(configs[2]), RunLayout.checkpoint_dir(2)).files
    assert {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"} <= set(files)
    assert {
        "trainer/state-00001-of-00002.safetensors",
        "trainer/state-00002-of-00002.safetensors",
        "trainer/state.safetensors.index.json",
        "trainer/progress.json",
    } <= set(files)
    optimizer = {n for n in s1.tensors if n.startswith("optimizer/")}
    assert optimizer and {n for n in s2.tensors if n.startswith("optimizer/")} == optimizer
    assert {n for n in s2.tensors if n.startswith("rng/")} == {"rng/rank0/cpu", "rng/rank1/cpu"}
    for name in optimizer:
        torch.testing.assert_close(s2.tensors[name], s1.tensors[name], rtol=1e-4, atol=1e-7)
    assert s2.progress["world_size"] == 2 and s2.progress["step"] == 2


def test_pool_exits_when_its_supervisor_dies(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = make_config(tmp_path, tiny_model_dir, "orphan", trainer={"rollout_timeout_s": 600})
    config_path = tmp_path / "config.json"
    config_path.write_text(config.model_dump_json())
    # The supervisor starts the pool (which waits for rollouts that never come), reports the
    # pool's process group, then is killed without any chance to clean up.
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from engine.config import PrimeflowConfig
        from engine.trainer.pool import TrainerPool
        config = PrimeflowConfig.model_validate_json(Path({str(config_path)!r}).read_text())
        pool = TrainerPool(config, "rl")
        pool.start()
        print(pool.pgid, flush=True)
        time.sleep(600)
        """
    )
    supervisor = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=os.getcwd()
    )
    assert supervisor.stdout is not None
    pgid = int(supervisor.stdout.readline())
    # Let the worker come up (imports, model load) so its watcher runs, then kill the supervisor.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(_tree(pgid)) < 2:
        time.sleep(0.5)
    assert len(_tree(pgid)) >= 2, "torchrun and its rank should be running"
    rank = _tree(pgid)[1]
    time.sleep(3)
    supervisor.send_signal(signal.SIGKILL)
    supervisor.wait()
    # The rank's watcher starts once its imports finish, which takes long on a loaded machine.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (_tree(pgid) or _tree(rank)):
        time.sleep(0.5)
    assert not _tree(pgid) and not _tree(rank), "the pool outlived its supervisor"


def _processes() -> dict[int, tuple[int, str]]:
    """pid → (parent pid, state) of every process."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            table[int(entry.name)] = (int(fields[1]), fields[0])
    return table


def _tree(root: int) -> list[int]:
    """Live (non-zombie) `root` and its descendants."""
    table = _processes()
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        if pid in table and table[pid][1] != "Z":
            found.append(pid)
        frontier += [child for child, (parent, _) in table.items() if parent == pid]
    return found
