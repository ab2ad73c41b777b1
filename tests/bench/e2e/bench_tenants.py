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
step parts (the trainer's and the orchestrator's, as `bench_gpu_rl` breaks a step down) with
the sampled tokens per second the tenants trained on (what the shared server delivered).

`--variant NAME=FLAGS` measures several tenant settings on the same pools, one after another
in each round (the pools start once: on the H200 that is 2-4 minutes of a 10-minute call).
FLAGS are config flags for the tenants only (the pools keep the base config); the default is
one variant, `async`, with none. The JSON result is rewritten after every phase, so a call
cut off by its time limit still brings back the phases it finished.

    python -m tests.bench.e2e.bench_tenants --steps 12 --out bench_tenants.json      # one GPU
    python -m tests.bench.e2e.bench_tenants --steps 14 --rounds 2 --mps -- --trainer.compile true \
        --trainer.micro-batch-tokens 16384                    # under MPS, compiled trainer
    # ... async tenants (the default) and strictly on-policy ones, on the same pools:
    #   --variant async= --variant 'on-policy=--orchestrator.max-async-level 0'
    # ... and two vLLM servers sharing the GPU (each half the memory share; on one H200 their
    # adapter swaps took 1.5-3 s, so they were slower than one): add  --inference.num-servers 2
    #   --inference.gpu-ids '[0,0]' --inference.gpu-memory-utilization 0.15
    # the instrument itself on a CPU machine, with the tiny shared pools of the example:
    python -m tests.bench.e2e.bench_tenants --config configs/multi_tenant/pools.toml \
        --model primeflow/tiny-qwen3 --steps 5 -- --orchestrator.batch-size 8
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import PrimeflowConfig, with_overrides
from engine.run import open_run, run_store
from engine.stages import run_rl
from engine.tenancy.attached import AttachedPool
from engine.tenancy.files import PoolRecord
from engine.tenancy.supervisor import SharedPools
from storage.metrics import read_metrics
from tests.bench.e2e.bench_async import emit, save
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


@dataclass(frozen=True)
class Variant:
    """Tenant settings to measure: a name for the table and config flags for the tenants."""

    name: str
    flags: tuple[str, ...] = ()


def parse_variant(text: str) -> Variant:
    """`NAME=FLAGS` (FLAGS split as a shell would) as a `Variant`."""
    name, _, flags = text.partition("=")
    if not name.strip():
        raise argparse.ArgumentTypeError(f"a variant is NAME=FLAGS, got {text!r}")
    return Variant(name.strip(), tuple(shlex.split(flags)))


def tenant_main(config_path: str) -> None:
    """One tenant's RL stage on the shared pools (a subprocess of `run_tenants`), logging its
    steps and swaps to its log file."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request
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
    steps = {}
    for name in names:
        store = run_store(with_overrides(config, {"run.name": name}))
        steps[name] = step_times(
            read_metrics(store, "rl"), read_metrics(store, "orchestrator"), started
        )
    start = max(lines[WARMUP_STEPS]["time"] for lines in steps.values())
    end = min(lines[-1]["time"] for lines in steps.values())
    inside = [step for lines in steps.values() for step in lines if start < step["time"] <= end]
    measured = [step for lines in steps.values() for step in lines[WARMUP_STEPS:]]
    return {
        "tenants": list(names),
        "step_times": {name: [step["time"] for step in lines] for name, lines in steps.items()},
        "window_s": end - start,
        "steps_in_window": len(inside),
        "steps_per_s": len(inside) / (end - start),
        "sampled_tokens_per_s": sum(step["sampled_tokens"] for step in inside) / (end - start),
        "median_s": {
            key: statistics.median(step[key] for step in measured)
            for key in (*STEP_TIMES, "sample_step_s")
        },
    }


def one_round(
    config: PrimeflowConfig, variant: Variant, workdir: Path, index: int
) -> Iterator[tuple[str, dict[str, Any]]]:
    """One tenant alone, then two at once, on the same running pools: each phase's result
    as it ends (`alone`, `together`), then the ratio (`aggregate_over_alone`)."""
    label = f"round {index}, {variant.name}"
    alone = run_tenants(config, [f"{variant.name}-alone-{index}"], workdir)
    print(f"{label}: one tenant alone {alone['steps_per_s']:.2f} steps/s", flush=True)
    yield "alone", alone
    names = [f"{variant.name}-first-{index}", f"{variant.name}-second-{index}"]
    together = run_tenants(config, names, workdir)
    ratio = together["steps_per_s"] / alone["steps_per_s"]
    print(f"{label}: two tenants {together['steps_per_s']:.2f} steps/s ({ratio:.2f}×)", flush=True)
    yield "together", together
    yield "aggregate_over_alone", ratio


def finished_ratios(variant: dict[str, Any]) -> list[float]:
    """A variant's aggregate-over-alone ratios, of the rounds that got that far."""
    return [r["aggregate_over_alone"] for r in variant["rounds"] if "aggregate_over_alone" in r]


def table(variants: dict[str, dict[str, Any]]) -> str:
    """Each variant's rates and median step parts by round, as Markdown (the docs' table)."""
    keys = (*STEP_TIMES, "sample_step_s")
    rows = [
        "| variant | round | tenants | steps/s | sampled tokens/s | " + " | ".join(keys) + " |",
        "|---" * (len(keys) + 5) + "|",
    ]
    for name, result in variants.items():
        for index, measured in enumerate(result["rounds"]):
            for setting in ("alone", "together"):
                if setting not in measured:
                    continue
                part = measured[setting]
                cells = " | ".join(f"{part['median_s'][key]:.2f}" for key in keys)
                rows.append(
                    f"| {name} | {index} | {len(part['tenants'])} | {part['steps_per_s']:.2f} "
                    f"| {part['sampled_tokens_per_s']:.0f} | {cells} |"
                )
    rows.append("")
    for name, result in variants.items():
        shown = ", ".join(f"{ratio:.2f}" for ratio in finished_ratios(result))
        rows.append(f"{name}: aggregate over alone, by round: {shown}")
    return "\n".join(rows)


def summarise(variants: dict[str, dict[str, Any]]) -> None:
    """Each variant's median ratio over the rounds that finished."""
    for result in variants.values():
        ratios = finished_ratios(result)
        result["aggregate_over_alone"] = statistics.median(ratios) if ratios else None


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
    parser.add_argument(
        "--variant",
        type=parse_variant,
        action="append",
        help="NAME=FLAGS: tenant settings to measure (repeat for several); default async=",
    )
    parser.add_argument("overrides", nargs="*", help="extra config flags, after --")
    args = parser.parse_args(argv)
    if args.tenant:
        tenant_main(args.tenant)
        return {}
    if args.steps <= WARMUP_STEPS + 1:
        parser.error(f"--steps must be more than {WARMUP_STEPS + 1}")
    variants: list[Variant] = args.variant or [Variant("async")]
    if len({variant.name for variant in variants}) != len(variants):
        parser.error("variant names must differ")
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench-tenants-", dir=args.workdir))
    os.environ["PRIMEFLOW_HOME"] = str(workdir / "home")  # the tenants inherit it
    files = args.config or [str(path) for path in CONFIGS]
    extra = [*LORA, *SMALL, "--pools.name", POOLS, "--pools.tenants", "2", *args.overrides]
    config = bench_config(files, workdir, args.model, args.steps, extra)
    tenants = {
        variant.name: bench_config(files, workdir, args.model, args.steps, [*extra, *variant.flags])
        for variant in variants
    }
    result: dict[str, Any] = {
        **run_facts(config, args.model, args.steps),
        "mps": args.mps,
        "variants": {v.name: {"flags": list(v.flags), "rounds": []} for v in variants},
    }
    with mps_daemon(workdir / "mps") if args.mps else nullcontext():
        pools = SharedPools(config)
        started = time.perf_counter()
        pools.start()
        result["pools_startup_s"] = time.perf_counter() - started
        print(f"pools ready in {result['pools_startup_s']:.0f} s", flush=True)
        stop = threading.Event()
        supervisor = threading.Thread(target=pools.serve, args=(stop,), daemon=True)
        supervisor.start()
        try:
            for index in range(args.rounds):
                for variant in variants:
                    measured: dict[str, Any] = {}
                    result["variants"][variant.name]["rounds"].append(measured)
                    for key, value in one_round(tenants[variant.name], variant, workdir, index):
                        measured[key] = value
                        save(result, args.out)  # what finished survives a cut-off call
        finally:
            stop.set()
            supervisor.join()
            pools.stop()
    summarise(result["variants"])
    emit(result, args.out)
    print(table(result["variants"]))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
