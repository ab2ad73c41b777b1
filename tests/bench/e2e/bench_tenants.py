"""Two LoRA tenants on one shared pool pair against one tenant alone on the same pools.

Issue 18's measure: aggregate RL steps per second of two tenants training at once on one
shared inference pool and one shared trainer, over one tenant alone on the very same pools
(started once, measured back to back). A small tenant leaves each pool idle while the other
half of its loop runs; a second tenant fills that time (target ≥ 1.5× on one H200).

Each tenant is a process of its own (as `primeflow rl` with `pools.name` would be), running
the RL stage through `engine.stages.run_rl` on its view of the shared servers. Steps per
second are read from each tenant's committed trainer metrics, leaving its first
`WARMUP_STEPS` out; together, the aggregate is every tenant's steps inside the window in which
all of them were training, over that window. `--rounds N` measures alone-then-together N
times on the same pools and reports the median ratio, each round's, and a table of the median
step parts (the trainer's and the orchestrator's, as `bench_gpu_rl` breaks a step down).

    python -m tests.bench.e2e.bench_tenants --steps 12 --out bench_tenants.json      # one GPU
    python -m tests.bench.e2e.bench_tenants --steps 14 --rounds 2 --mps -- --trainer.compile true \
        --trainer.micro-batch-tokens 16384                    # under MPS, compiled trainer
    # ... and two vLLM servers sharing the GPU (each half the memory share), to lift the
    # serving path's per-server ceiling: add  --inference.num-servers 2
    #   --inference.gpu-ids '[0,0]' --inference.gpu-memory-utilization 0.15
    # the instrument itself on a CPU machine, with the tiny shared pools of the example:
    python -m tests.bench.e2e.bench_tenants --config configs/multi_tenant/pools.toml \
        --model primeflow/tiny-qwen3 --steps 5 -- --orchestrator.batch-size 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from engine.config import PrimeflowConfig, with_overrides
from engine.inference.attached import AttachedPool
from engine.run import open_run, run_store
from engine.shared_pools import SharedPools
from engine.stages import run_rl
from engine.tenancy import PoolRecord
from storage.metrics import read_metrics
from tests.bench.e2e.bench_async import emit
from tests.bench.e2e.bench_gpu_rl import (
    CONFIGS,
    STEP_TIMES,
    WARMUP_STEPS,
    bench_config,
    run_facts,
    step_times,
)

POOLS = "bench"
#: A small tenant: 4 prompts × 8 samples a step.
SMALL = ["--orchestrator.batch-size", "32", "--orchestrator.rollouts-per-example", "8"]
LORA = ["--trainer.lora.rank", "16", "--trainer.lora.alpha", "32"]


@contextmanager
def mps_daemon(folder: Path) -> Iterator[None]:
    """An NVIDIA MPS server for this process and its children (the pools and the tenants):
    their kernels then share the GPU at once instead of time-slicing it. Its pipe and log
    folders are private, so no other process on the machine connects to it."""
    folder.mkdir(parents=True)
    os.environ["CUDA_MPS_PIPE_DIRECTORY"] = str(folder)
    os.environ["CUDA_MPS_LOG_DIRECTORY"] = str(folder)
    subprocess.run(["nvidia-cuda-mps-control", "-d"], check=True, timeout=60)
    try:
        yield
    finally:
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, timeout=60)


def tenant_main(config_path: str) -> None:
    """One tenant's RL stage on the shared pools (a subprocess of `run_tenants`)."""
    config = PrimeflowConfig.model_validate_json(Path(config_path).read_text())
    view = AttachedPool.from_record(PoolRecord.read(POOLS), config)
    try:
        run_rl(config, open_run(config), view)
    finally:
        view.close()


def run_tenants(config: PrimeflowConfig, names: Sequence[str], workdir: Path) -> dict[str, Any]:
    """Run tenants `names` at once to the end; their step times and the aggregate rate."""
    processes = []
    started = time.time()
    for seed, name in enumerate(names):
        tenant = with_overrides(config, {"run.name": name, "run.seed": seed})
        path = workdir / f"{name}.json"
        path.write_text(tenant.model_dump_json())
        log = (workdir / f"{name}.log").open("wb")
        command = [sys.executable, "-m", "tests.bench.e2e.bench_tenants", "--tenant", str(path)]
        processes.append((name, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)))
    for name, process in processes:
        if process.wait() != 0:
            raise RuntimeError(f"tenant {name} failed; see {workdir / f'{name}.log'}")
    stores = {name: run_store(with_overrides(config, {"run.name": name})) for name in names}
    train = {name: read_metrics(store, "rl") for name, store in stores.items()}
    parts = [
        step
        for name, store in stores.items()
        for step in step_times(train[name], read_metrics(store, "orchestrator"), started)[
            WARMUP_STEPS:
        ]
    ]
    times = {name: [line["time"] for line in lines] for name, lines in train.items()}
    start = max(steps[WARMUP_STEPS] for steps in times.values())
    end = min(steps[-1] for steps in times.values())
    inside = sum(sum(1 for t in steps if start < t <= end) for steps in times.values())
    return {
        "tenants": list(names),
        "step_times": times,
        "window_s": end - start,
        "steps_in_window": inside,
        "steps_per_s": inside / (end - start),
        "median_s": {
            key: statistics.median(step[key] for step in parts)
            for key in (*STEP_TIMES, "sample_step_s")
        },
    }


def one_round(config: PrimeflowConfig, workdir: Path, index: int) -> dict[str, Any]:
    """One tenant alone, then two at once, on the same running pools."""
    alone = run_tenants(config, [f"alone-{index}"], workdir)
    print(f"round {index}: one tenant alone {alone['steps_per_s']:.2f} steps/s", flush=True)
    together = run_tenants(config, [f"first-{index}", f"second-{index}"], workdir)
    ratio = together["steps_per_s"] / alone["steps_per_s"]
    print(
        f"round {index}: two tenants {together['steps_per_s']:.2f} steps/s ({ratio:.2f}×)",
        flush=True,
    )
    return {"alone": alone, "together": together, "aggregate_over_alone": ratio}


def table(rounds: Sequence[dict[str, Any]]) -> str:
    """Each round's rates and median step parts, as Markdown (the docs' table)."""
    keys = (*STEP_TIMES, "sample_step_s")
    rows = [
        "| round | tenants | steps/s | " + " | ".join(keys) + " |",
        "|---" * (len(keys) + 3) + "|",
    ]
    for index, result in enumerate(rounds):
        for setting in ("alone", "together"):
            part = result[setting]
            cells = " | ".join(f"{part['median_s'][key]:.2f}" for key in keys)
            tenants = len(part["tenants"])
            rows.append(f"| {index} | {tenants} | {part['steps_per_s']:.2f} | {cells} |")
    ratios = ", ".join(f"{result['aggregate_over_alone']:.2f}" for result in rounds)
    return "\n".join([*rows, "", f"aggregate over alone, by round: {ratios}"])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.e2e.bench_tenants")
    parser.add_argument("--tenant", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="primeflow/qwen3-0.6b-body")
    parser.add_argument("--config", action="append", help="config files composed in order")
    parser.add_argument("--steps", type=int, default=12, help="RL steps of each tenant")
    parser.add_argument("--workdir", default=None, help="a fresh folder is made in it")
    parser.add_argument("--out", default=None, help="write the JSON result here too")
    parser.add_argument("--mps", action="store_true", help="run everything under NVIDIA MPS")
    parser.add_argument(
        "--rounds", type=int, default=1, help="alone-then-together rounds on the same pools"
    )
    parser.add_argument("overrides", nargs="*", help="extra config flags, after --")
    args = parser.parse_args(argv)
    if args.tenant:
        tenant_main(args.tenant)
        return {}
    if args.steps <= WARMUP_STEPS + 1:
        parser.error(f"--steps must be more than {WARMUP_STEPS + 1}")
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench-tenants-", dir=args.workdir))
    os.environ["PRIMEFLOW_HOME"] = str(workdir / "home")  # the tenants inherit it
    files = args.config or [str(path) for path in CONFIGS]
    extra = [*LORA, *SMALL, "--pools.name", POOLS, "--pools.tenants", "2", *args.overrides]
    config = bench_config(files, workdir, args.model, args.steps, extra)
    with mps_daemon(workdir / "mps") if args.mps else nullcontext():
        pools = SharedPools(config)
        started = time.perf_counter()
        pools.start()
        startup_s = time.perf_counter() - started
        print(f"pools ready in {startup_s:.0f} s", flush=True)
        stop = threading.Event()
        supervisor = threading.Thread(target=pools.serve, args=(stop,), daemon=True)
        supervisor.start()
        try:
            rounds = [one_round(config, workdir, index) for index in range(args.rounds)]
        finally:
            stop.set()
            supervisor.join()
            pools.stop()
    result = {
        **run_facts(config, args.model, args.steps),
        "mps": args.mps,
        "pools_startup_s": startup_s,
        "rounds": rounds,
        "aggregate_over_alone": statistics.median(r["aggregate_over_alone"] for r in rounds),
    }
    emit(result, args.out)
    print(table(rounds))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
