"""The trainer pool: torchrun in its own process group, supervised by the caller.

`run_trainer(config, stage)` is what `primeflow trainer` / `primeflow sft` call: it writes the
resolved config to a file, starts `torchrun ... -m engine.trainer.worker` in a new session (so
signals for the pool never reach the caller), waits for it, and always stops it on the way out.

Stopping: SIGTERM to torchrun, which stops its ranks (each runs in a session of its own), then
SIGKILL after a grace period. Ranks watch both the caller and torchrun and kill themselves when
either is gone (`engine.trainer.supervision`), so even a SIGKILLed caller or torchrun leaves
nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import psutil

from engine.config import PrimeflowConfig
from engine.process_groups import process_tree
from engine.trainer.supervision import SUPERVISOR_ENV
from engine.watchdog import STACKS_DIR_ENV
from storage.layout import Stage

#: What a trainer pool runs: one stage of one run, or the tenants of shared pools
#: (`engine.tenancy.shared_trainer`).
PoolStage = Stage | Literal["tenants"]
#: A Python exception's summary line in a log: `package.module.SomeError: message`, after the
#: `[rank0]: ` that torchrun puts before each line of a rank's output.
_EXCEPTION_LINE = re.compile(
    r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception): \S.*)$"
)
#: torchrun's own report that a rank failed: it says nothing about why.
_TORCHRUN_SUMMARY = "ChildFailedError"
#: Written to the (appended) log before each start, so a failure is read from the lines of its
#: own attempt, never from an earlier attempt's.
_START_LINE = "=== primeflow: trainer pool started"


def torchrun_command(config: PrimeflowConfig, stage: PoolStage, config_path: Path) -> list[str]:
    """The torchrun command line for this node (standalone, or c10d rendezvous across nodes)."""
    parallel = config.trainer.parallel
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={parallel.nproc_per_node}",
        f"--nnodes={parallel.nnodes}",
    ]
    if parallel.nnodes == 1:
        command.append("--standalone")
    else:
        command += [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={parallel.rdzv_endpoint}",
            f"--rdzv-id={config.run.name}",
        ]
    if stage == "tenants":
        return [*command, "-m", "engine.tenancy.shared_trainer", "--config", str(config_path)]
    return [*command, "-m", "engine.trainer.worker", "--config", str(config_path), "--stage", stage]


def rank_environment(config: PrimeflowConfig, parent: Mapping[str, str]) -> dict[str, str]:
    """The environment torchrun and its ranks start with: `parent`'s, plus the trainer's threads
    and GPUs.

    OpenMP's threads sleep at barriers unless `parent` says otherwise: libgomp spins ~300,000
    times first, burning a core another process is waiting for. On a loaded 2-core machine the
    CPU demo's SFT took 5 min 1 s with them spinning and 1 min 15 s asleep (docs/benchmarks.md,
    "PPO's clipped surrogate"). libgomp reads the setting once, when torch loads it, so it must
    be in the environment the ranks start with.
    """
    env = {"OMP_WAIT_POLICY": "PASSIVE", **parent}
    if config.trainer.num_threads is not None:
        env["OMP_NUM_THREADS"] = str(config.trainer.num_threads)
    if config.trainer.parallel.gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, config.trainer.parallel.gpu_ids))
    return env


class TrainerPool:
    """One node's share of the trainer: a torchrun process group."""

    def __init__(
        self, config: PrimeflowConfig, stage: PoolStage, *, log_path: Path | None = None
    ) -> None:
        self.config = config
        self.stage = stage
        self.log_path = log_path
        self._tmp = tempfile.TemporaryDirectory(prefix="primeflow-trainer-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pgid(self) -> int:
        """torchrun's process group id (its pid), for supervisors that record it; killing this
        group stops the ranks too, through their watchers."""
        if self.process is None:
            raise RuntimeError("the pool has not been started")
        return self.process.pid

    @property
    def stacks_dir(self) -> Path:
        """Where each rank keeps the file it dumps its stacks into (`engine.watchdog`)."""
        assert self.log_path is not None
        return self.log_path.parent / "stacks"

    def start(self) -> None:
        config_path = Path(self._tmp.name) / "config.json"
        config_path.write_text(self.config.model_dump_json())
        env = {**rank_environment(self.config, os.environ), SUPERVISOR_ENV: str(os.getpid())}
        log = None
        if self.log_path is not None:
            env[STACKS_DIR_ENV] = str(self.stacks_dir)
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = self.log_path.open("ab")
            log.write(f"{_START_LINE} at {time.strftime('%Y-%m-%d %H:%M:%S')} ===\n".encode())
            log.flush()
        try:
            self.process = subprocess.Popen(
                torchrun_command(self.config, self.stage, config_path),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT if log is not None else None,
                start_new_session=True,
            )
        finally:
            if log is not None:
                log.close()

    def last_error(self, tail_bytes: int = 64 * 1024) -> str | None:
        """The last exception line this start's ranks logged (e.g. a `PermanentStorageError`
        naming the URI it could not write), or None."""
        if self.log_path is None:
            return None
        try:
            with self.log_path.open("rb") as log:
                log.seek(max(0, self.log_path.stat().st_size - tail_bytes))
                lines = log.read().decode(errors="replace").splitlines()
        except OSError:
            return None
        for line in reversed(lines):
            if line.startswith(_START_LINE):
                break
            found = _EXCEPTION_LINE.match(line.strip())
            if found and _TORCHRUN_SUMMARY not in line:
                return found.group(1)
        return None

    def poll(self) -> int | None:
        """torchrun's exit status, or None while it runs."""
        if self.process is None:
            raise RuntimeError("the pool has not been started")
        return self.process.poll()

    def wait(self, timeout: float | None = None) -> int:
        if self.process is None:
            raise RuntimeError("the pool has not been started")
        return self.process.wait(timeout)

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM torchrun (it stops its ranks), then SIGKILL its group after `grace_s`.

        A rank that outlives torchrun is killed too: one stopped (SIGSTOP) or stuck holds its
        SIGTERM, and its supervisor watch cannot run to end it.
        """
        if self.process is not None and self.process.poll() is None:
            ranks = process_tree(self.process.pid)[1:]
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait()
            for rank in ranks:
                with contextlib.suppress(psutil.NoSuchProcess):
                    rank.kill()
            psutil.wait_procs(ranks, timeout=grace_s)
        self._tmp.cleanup()

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, sig)


def run_trainer(config: PrimeflowConfig, stage: Stage) -> int:
    """Run the trainer pool for `stage` in the foreground; return torchrun's exit code."""
    pool = TrainerPool(config, stage)
    pool.start()
    try:
        return pool.wait()
    finally:
        pool.stop()
