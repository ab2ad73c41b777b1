"""The trainer pool's part of an RL step, for the Prefect overhead benchmark.

The flow process of a real run mostly waits while other processes (vLLM, torchrun) compute,
and learns about each step only from what they commit. This stand-in does the same from its
own process: a fixed amount of one-core compute per step, counted in CPU seconds (so CPU that
orchestration takes shows up as a longer step, never as less work, and other jobs on a shared
machine change how long a step takes but not what it does), then what the trainer commits each
step — one metric line and one checkpoint with its `_COMMITTED` marker.

    python -m tests.bench.prefect.stand_in_trainer --root file:///tmp/run --steps 6 --cpu-s 5
"""

from __future__ import annotations

import argparse
import os
import time

# One core, as a rank pinned to its device would use; set before numpy loads its BLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np

from storage.commit import commit_step, digest_bytes
from storage.layout import RunLayout
from storage.metrics import write_metrics
from storage.store import ObjectStore

#: Bytes of the stand-in checkpoint; the monitor only lists markers, so size barely matters.
CHECKPOINT_BYTES = 1 << 20


def work(cpu_s: float) -> None:
    """Matrix products until this process has spent `cpu_s` more seconds on a core."""
    a = np.random.default_rng(0).random((256, 256))
    end = time.process_time() + cpu_s
    while time.process_time() < end:
        a = np.tanh(a @ a.T / 256.0)


def train(root: str, steps: int, cpu_s: float) -> float:
    """Run `steps` steps; the seconds from the first step's start to the last commit."""
    store = ObjectStore(root)
    payload = bytes(CHECKPOINT_BYTES)
    first = time.perf_counter()
    for step in range(1, steps + 1):
        started = time.perf_counter()
        work(cpu_s)
        write_metrics(
            store,
            "rl",
            step,
            {
                "loss": 1.0 / step,
                "reward/mean": 0.1 * step,
                "step_s": time.perf_counter() - started,
            },
        )
        folder = RunLayout.checkpoint_dir(step)
        store.write_bytes(f"{folder}/model.safetensors", payload)
        commit_step(store, folder, {"model.safetensors": digest_bytes(payload)}, step=step)
    return time.perf_counter() - first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--cpu-s", type=float, required=True, help="CPU seconds per step")
    args = parser.parse_args()
    print(train(args.root, args.steps, args.cpu_s))


if __name__ == "__main__":
    main()
