"""Storage benchmark: rollout shards and checkpoints against a raw copy of the same bytes.

    .venv/bin/python -m tests.bench.storage.bench_storage            # file:// and moto S3
    .venv/bin/python -m tests.bench.storage.bench_storage --backends file --profile
    make bench        # every benchmark, this one through tests/bench/storage/test_bench_storage.py

Each case times a storage-layer operation and a raw baseline through the same `ObjectStore`, then
reports both in MB/s and their ratio (layer / raw; 1.0 means the layer adds nothing). The
baseline moves *exactly the bytes the layer stored*, as the same number of objects with the same
sizes, through the store's own `write_bytes` / `read_bytes` / `download_file`. That is the fairest
baseline because it differs from the operation only in what the layer adds (Arrow encoding and
decoding, schema validation, safetensors serialisation, checksums, the commit marker, the verified
fetch), while transport, object count and object sizes are identical. A plain `shutil.copyfile`
would measure a disk-to-disk copy, which moves each byte twice and no layer operation does.

Files written on `file://` land in the page cache and are read back from it, for the layer and the
baseline alike. Every case runs `--repeats` times, operation and baseline back to back (their
order alternating); the ratio is the median of the per-pair ratios, which cancels load that
drifts during the run, and the MB/s columns are medians. `cpu ratio` is the same in this
process's CPU time. Default `pytest` runs never collect it: its testpaths leave out tests/bench.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from storage.checkpoints import fetch_checkpoint, write_checkpoint
from storage.layout import RunLayout
from storage.shards import read_rollouts, write_rollouts
from storage.store import ObjectStore
from tests.integration.servers import s3_environment, start_moto
from tests.integration.storage.data import rollout_table

MB = 1e6
TARGET_RATIO = 0.8
# A step written once, untimed, to capture the exact bytes the raw baseline then moves.
WARM_STEP = 1000


@dataclass
class Timing:
    """Wall-clock and CPU seconds (this process only) of each run."""

    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)


@dataclass
class Case:
    """One measured operation: the layer's times, the baseline's times, the bytes moved."""

    backend: str
    name: str
    nbytes: int
    layer: Timing
    raw: Timing

    @property
    def layer_s(self) -> list[float]:
        return self.layer.wall_s

    @property
    def raw_s(self) -> list[float]:
        return self.raw.wall_s

    @property
    def layer_mb_s(self) -> float:
        return self.nbytes / MB / statistics.median(self.layer_s)

    @property
    def raw_mb_s(self) -> float:
        return self.nbytes / MB / statistics.median(self.raw_s)

    @property
    def ratio(self) -> float:
        """Median over repeats of raw time / layer time, each pair run back to back.

        Pairing cancels load that drifts over the run (other jobs on a shared machine)."""
        return statistics.median(r / x for r, x in zip(self.raw_s, self.layer_s, strict=True))

    @property
    def cpu_ratio(self) -> float:
        """The same ratio in this process's CPU time: steadier when other work shares the
        machine, but blind to time spent in a server process or waiting on the disk."""
        pairs = zip(self.raw.cpu_s, self.layer.cpu_s, strict=True)
        return statistics.median(r / x for r, x in pairs)


Step = Callable[[int], object]


def _timed(fn: Callable[[], object], timing: Timing) -> None:
    # Flush the previous run's dirty pages first (untimed): otherwise the kernel's writeback of
    # one run throttles whichever run comes next, and the order decides the ratio.
    os.sync()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    timing.wall_s.append(time.perf_counter() - wall)
    timing.cpu_s.append(time.process_time() - cpu)


def _alternate(
    layer: tuple[Step, Step], raw: tuple[Step, Step], repeats: int
) -> tuple[Timing, Timing]:
    """Run layer and raw `repeats` times each, back to back, swapping which goes first.

    Each side is `(run, clean_up)`; the clean-up (untimed) deletes what the run wrote, so every
    run starts from the same state rather than on top of the debris of the runs before it.
    """
    layer_t, raw_t = Timing(), Timing()
    for rep in range(repeats):
        pair = [(layer, layer_t), (raw, raw_t)]
        for (run, clean_up), timing in pair if rep % 2 == 0 else reversed(pair):
            _timed(lambda run=run, rep=rep: run(rep), timing)
            clean_up(rep)
    return layer_t, raw_t


def with_step(table: pa.Table, step: int) -> pa.Table:
    """`table` with every row's `step` set to `step`, sharing all other columns."""
    index = table.schema.get_field_index("step")
    column = pa.array(np.full(table.num_rows, step, dtype=np.int64))
    return table.set_column(index, table.schema.field(index), column)


def state_dict(total_bytes: int) -> dict[str, torch.Tensor]:
    """bf16 tensors shaped like a small transformer's, `total_bytes` in all (within a layer)."""
    hidden = 1024
    layer = {
        "self_attn.q_proj.weight": (hidden, hidden),
        "self_attn.k_proj.weight": (hidden // 4, hidden),
        "self_attn.v_proj.weight": (hidden // 4, hidden),
        "self_attn.o_proj.weight": (hidden, hidden),
        "mlp.gate_proj.weight": (4 * hidden, hidden),
        "mlp.up_proj.weight": (4 * hidden, hidden),
        "mlp.down_proj.weight": (hidden, 4 * hidden),
        "input_layernorm.weight": (hidden,),
    }
    per_layer = sum(torch.Size(shape).numel() * 2 for shape in layer.values())
    generator = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for index in range(max(1, round(total_bytes / per_layer))):
        for name, shape in layer.items():
            tensors[f"model.layers.{index}.{name}"] = torch.randn(shape, generator=generator).to(
                torch.bfloat16
            )
    return tensors


def bench_shards(backend: str, store: ObjectStore, target_bytes: int, seq_len: int, repeats: int):
    """Write and read ~`target_bytes` of rollout rows as one committed step."""
    per_row = rollout_table(4, step=0, seq_len=seq_len).nbytes / 4
    rows = max(1, int(target_bytes / per_row))
    base = rollout_table(rows, step=0, seq_len=seq_len)
    # One table per step (a step's rows must carry its number); all share every other column.
    tables = {rep: with_step(base, rep) for rep in [*range(repeats), WARM_STEP]}

    # The raw baseline moves exactly the shard bytes the layer wrote, fetched once untimed.
    warm = write_rollouts(store, WARM_STEP, tables[WARM_STEP])
    warm_dir = RunLayout.rollouts_dir(WARM_STEP)
    blobs = {name: store.read_bytes(f"{warm_dir}/{name}") for name in warm.files}
    nbytes = sum(len(blob) for blob in blobs.values())

    def raw_write(folder: str) -> None:
        for name, blob in blobs.items():
            store.write_bytes(f"{folder}/{name}", blob)

    layer_w, raw_w = _alternate(
        (
            lambda rep: write_rollouts(store, rep, tables[rep]),
            lambda rep: store.delete(RunLayout.rollouts_dir(rep)),
        ),
        (lambda rep: raw_write(f"raw/shards/{rep}"), lambda rep: store.delete("raw/shards")),
        repeats,
    )
    raw_write("raw/shards/read")

    def raw_read(rep: int) -> None:
        for name in blobs:
            store.read_bytes(f"raw/shards/read/{name}")

    layer_r, raw_r = _alternate(
        (lambda rep: read_rollouts(store, WARM_STEP), lambda rep: None),
        (raw_read, lambda rep: None),
        repeats,
    )
    store.delete(RunLayout.ROLLOUTS)
    store.delete("raw/shards")
    detail = f"{rows} rows x {seq_len} tokens, {len(blobs)} shards, {nbytes / MB:.0f} MB stored"
    return [
        Case(backend, "shard write", nbytes, layer_w, raw_w),
        Case(backend, "shard read", nbytes, layer_r, raw_r),
    ], detail


def bench_checkpoints(
    backend: str, store: ObjectStore, target_bytes: int, repeats: int, scratch: Path
):
    """Write and fetch a ~`target_bytes` bf16 state dict as one committed checkpoint."""
    weights = state_dict(target_bytes)
    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}

    warm = write_checkpoint(store, WARM_STEP, weights=weights, config=config)
    warm_dir = RunLayout.checkpoint_dir(WARM_STEP)
    blobs = {name: store.read_bytes(f"{warm_dir}/{name}") for name in warm.files}
    nbytes = sum(len(blob) for blob in blobs.values())

    def raw_write(folder: str) -> None:
        for name, blob in blobs.items():
            store.write_bytes(f"{folder}/{name}", blob)

    layer_w, raw_w = _alternate(
        (
            lambda rep: write_checkpoint(store, rep, weights=weights, config=config),
            lambda rep: store.delete(RunLayout.checkpoint_dir(rep)),
        ),
        (lambda rep: raw_write(f"raw/ckpt/{rep}"), lambda rep: store.delete("raw/ckpt")),
        repeats,
    )
    raw_write("raw/ckpt/read")
    blobs.clear()  # frees the copy before the fetch runs

    def raw_fetch(rep: int) -> None:
        folder = scratch / f"raw-{rep}"
        folder.mkdir(parents=True, exist_ok=True)
        for name in warm.files:
            store.download_file(f"raw/ckpt/read/{name}", folder / name.replace("/", "_"))

    layer_r, raw_r = _alternate(
        (
            lambda rep: fetch_checkpoint(store, WARM_STEP, scratch / f"fetched-{rep}"),
            lambda rep: shutil.rmtree(scratch / f"fetched-{rep}"),
        ),
        (raw_fetch, lambda rep: shutil.rmtree(scratch / f"raw-{rep}")),
        repeats,
    )
    store.delete(RunLayout.CHECKPOINTS)
    store.delete("raw/ckpt")
    detail = f"{len(weights)} bf16 tensors, {len(warm.files)} files, {nbytes / MB:.0f} MB stored"
    return [
        Case(backend, "checkpoint write", nbytes, layer_w, raw_w),
        Case(backend, "checkpoint fetch", nbytes, layer_r, raw_r),
    ], detail


@contextlib.contextmanager
def backend_store(backend: str, scratch: Path) -> Iterator[ObjectStore]:
    """A store on `file://` in a scratch folder, or on a moto S3 server started for the run."""
    if backend == "file":
        yield ObjectStore(f"file://{scratch / 'store'}")
        return
    server, endpoint = start_moto(scratch / "moto", bucket="primeflow-bench")
    print(f"moto S3 server on {endpoint.url} (started in {server.startup_s:.1f}s)", flush=True)
    try:
        with s3_environment(endpoint):
            yield ObjectStore(endpoint.uri("bench"))
    finally:
        server.stop()


def profile_layer(store: ObjectStore, args: argparse.Namespace, out: io.TextIOBase) -> None:
    """cProfile one shard write/read and one checkpoint write/fetch; print where time goes."""
    per_row = rollout_table(4, step=0, seq_len=args.seq_len).nbytes / 4
    table = rollout_table(int(args.shard_mb * MB / per_row), step=7, seq_len=args.seq_len)
    weights = state_dict(int(args.checkpoint_mb * MB))
    config = {"model_type": "qwen3"}
    scratch = Path(tempfile.mkdtemp(prefix="primeflow-bench-profile-"))
    calls: list[tuple[str, Callable[[], object]]] = [
        ("shard write", lambda: write_rollouts(store, 7, table)),
        ("shard read", lambda: read_rollouts(store, 7)),
        ("checkpoint write", lambda: write_checkpoint(store, 7, weights=weights, config=config)),
        ("checkpoint fetch", lambda: fetch_checkpoint(store, 7, scratch / "ckpt")),
    ]
    try:
        for name, call in calls:
            profiler = cProfile.Profile()
            profiler.runcall(call)
            stream = io.StringIO()
            pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(12)
            out.write(f"\n--- profile: {name} (by own time) ---\n")
            out.write("\n".join(stream.getvalue().splitlines()[4:]) + "\n")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        store.delete(RunLayout.ROLLOUTS)
        store.delete(RunLayout.CHECKPOINTS)


def format_table(cases: list[Case]) -> str:
    header = (
        f"{'backend':<8} {'case':<17} {'MB':>5} {'layer MB/s':>11} {'raw MB/s':>9} "
        f"{'ratio':>6} {'cpu ratio':>10}"
    )
    lines = [header, "-" * len(header)]
    for case in cases:
        lines.append(
            f"{case.backend:<8} {case.name:<17} {case.nbytes / MB:>5.0f} "
            f"{case.layer_mb_s:>11.0f} {case.raw_mb_s:>9.0f} {case.ratio:>6.2f} "
            f"{case.cpu_ratio:>10.2f}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> list[Case]:
    cases: list[Case] = []
    for backend in args.backends:
        scratch = Path(tempfile.mkdtemp(prefix=f"primeflow-bench-{backend}-"))
        try:
            with backend_store(backend, scratch) as store:
                shard_cases, shard_detail = bench_shards(
                    backend, store, int(args.shard_mb * MB), args.seq_len, args.repeats
                )
                print(f"[{backend}] shards: {shard_detail}", flush=True)
                ckpt_cases, ckpt_detail = bench_checkpoints(
                    backend, store, int(args.checkpoint_mb * MB), args.repeats, scratch / "local"
                )
                print(f"[{backend}] checkpoints: {ckpt_detail}", flush=True)
                cases += shard_cases + ckpt_cases
                if args.profile:
                    profile_layer(store, args, sys.stdout)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return cases


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backends",
        type=lambda text: text.split(","),
        default=["file", "s3"],
        help="comma-separated: file, s3 (a moto server started for the run)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per case; medians are used")
    parser.add_argument("--shard-mb", type=float, default=256, help="rollout rows, in MB")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per rollout row")
    parser.add_argument("--checkpoint-mb", type=float, default=512, help="state dict, in MB")
    parser.add_argument("--profile", action="store_true", help="cProfile each layer operation")
    args = parser.parse_args(argv)
    unknown = set(args.backends) - {"file", "s3"}
    if unknown:
        parser.error(f"unknown backends {sorted(unknown)}: use file, s3")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> list[Case]:
    args = parse_args(argv)
    began = time.monotonic()
    load_before = os.getloadavg()[0]
    cases = run(args)
    print(
        f"\nstorage benchmark, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, "
        f"median of {args.repeats}, {time.monotonic() - began:.0f}s in all, load average "
        f"{load_before:.1f} before / {os.getloadavg()[0]:.1f} after"
    )
    print(f"ratio = layer / raw (same bytes, same store); target on file:// >= {TARGET_RATIO}")
    print(format_table(cases))
    missed = [c for c in cases if c.backend == "file" and c.ratio < TARGET_RATIO]
    if missed:
        names = ", ".join(case.name for case in missed)
        print(f"below target on file://: {names} (rerun with --profile to see where time goes)")
    return cases


if __name__ == "__main__":
    main()
