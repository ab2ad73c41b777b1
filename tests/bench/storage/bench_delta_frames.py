"""A policy delta in zstd frames on threads against one frame: its compression (the trainer's
write) and its decompression (each server's swap), both on the RL loop's critical path.

    .venv/bin/python -m tests.bench.storage.bench_delta_frames            # this machine
    python -m tests.bench.storage.bench_delta_frames --device cuda        # the GPU machine

Weights shaped like `primeflow/qwen3-char-76m` (bf16, `tests.bench.inference.bench_delta_apply`)
and a next version with `--density` of their entries changed (0.32: the median of an RL step of
`configs/reverse_text/gpu.toml` at lr 1e-4 on an H100). The packed entries are compressed with
`FRAME_BYTES` frames and with one frame, and each delta is decoded onto `--device` as a server
decodes it (decompressed on the host, the rest where it goes), alternating which goes first,
`--repeats` times; both decode to the same entries. Ratios are frames / one
frame, medians of the pairs: below 1.0 the frames are quicker. They scale with the cores (up to
8 threads); the 2-core dev machine shows the least of it, and there the host's unshuffle and
running sum, which a GPU does in milliseconds, outweigh the decompression.

The file name does not match `test_*.py`, so test runs never collect it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from storage.deltas import FRAME_BYTES, Delta, compress_entries, decode_delta, packed_between
from tests.bench.inference.bench_delta_apply import next_version, timed, weights


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.storage.bench_delta_frames")
    parser.add_argument("--density", type=float, default=0.32)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="where the deltas are decoded")
    args = parser.parse_args(argv)
    old = weights(args.layers, "cpu")
    parts, packed, count = packed_between(old, next_version(old, args.density))
    frame_sizes = {"frames": FRAME_BYTES, "one": len(packed)}
    deltas: dict[str, Delta] = {}
    compress: dict[str, list[float]] = {way: [] for way in frame_sizes}
    decode: dict[str, list[float]] = {way: [] for way in frame_sizes}
    for repeat in range(args.repeats):
        for way in sorted(frame_sizes, reverse=repeat % 2 == 1):

            def compressed(way: str = way) -> None:
                deltas[way] = compress_entries(parts, packed, count, frame_sizes[way])

            compress[way].append(timed(compressed, "cpu"))
        for way in sorted(frame_sizes, reverse=repeat % 2 == 0):
            decode[way].append(
                timed(lambda way=way: decode_delta(deltas[way], args.device), args.device)
            )
    for (_, one_positions, one_signed), (_, positions, signed) in zip(
        decode_delta(deltas["one"]), decode_delta(deltas["frames"]), strict=True
    ):
        if not (torch.equal(one_positions, positions) and torch.equal(one_signed, signed)):
            raise AssertionError("the framed delta decodes to other entries")
    result = {
        "cores": float(os.cpu_count() or 1),
        "changed_m": count / 1e6,
        "raw_mb": packed.nbytes / 1e6,
        "compressed_mb": deltas["frames"].compressed_bytes / 1e6,
        **{f"compress_{way}_s": statistics.median(compress[way]) for way in frame_sizes},
        **{f"decode_{way}_s": statistics.median(decode[way]) for way in frame_sizes},
        "compress_ratio": statistics.median(
            f / o for f, o in zip(compress["frames"], compress["one"], strict=True)
        ),
        "decode_ratio": statistics.median(
            f / o for f, o in zip(decode["frames"], decode["one"], strict=True)
        ),
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
