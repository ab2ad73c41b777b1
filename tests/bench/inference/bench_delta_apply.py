"""What a server's swap of one policy version costs: a delta version against the full one.

    .venv/bin/python -m tests.bench.inference.bench_delta_apply                # CPU
    python -m tests.bench.inference.bench_delta_apply --device cuda            # the GPU machine

Weights shaped like `primeflow/qwen3-char-76m` (bf16) lie on `--device`; the next version
changes `--density` of their entries (16 %: an RL step of configs/reverse_text/gpu.toml). Both
versions are files in the page cache. Each repeat times, back to back and alternating, what a
worker does with each: the delta read, decoded and applied in place (`storage.deltas`), and the
full version read and copied into the same tensors. The ratio is delta / full, median of the
pairs: below 1.0 the delta swap is the cheaper one on this machine, besides being smaller on
the wire. Both results are checked bit for bit against the new weights.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from storage.deltas import apply_delta, delta_between, encode_delta_file, read_delta_file

#: (rows, columns) of one layer's matrices as a server packs them (q/k/v, o, gate/up, down) and
#: of the embedding, for the 76M GPU model (12 × 768, GQA 12/4, MLP 2048): 12 layers.
LAYER = [(1280, 768), (768, 768), (4096, 768), (768, 2048)]
EMBEDDING = (512, 768)


def weights(layers: int, device: str) -> dict[str, torch.Tensor]:
    shapes = {"embed": EMBEDDING} | {
        f"layers.{i}.w{j}": shape for i in range(layers) for j, shape in enumerate(LAYER)
    }
    return {
        name: (torch.randn(shape, device=device) * 0.02).to(torch.bfloat16)
        for name, shape in shapes.items()
    }


def next_version(old: dict[str, torch.Tensor], density: float) -> dict[str, torch.Tensor]:
    """`old` with `density` of the entries moved by one step of a small relative update."""
    new = {}
    for name, tensor in old.items():
        values = tensor.float()
        moved = torch.rand_like(values) < density
        new[name] = torch.where(moved, values * 1.01 + 1e-6, values).to(tensor.dtype)
    return new


def timed(action: Callable[[], object], device: str) -> float:
    started = time.perf_counter()
    action()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.inference.bench_delta_apply")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--density", type=float, default=0.16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    old = weights(args.layers, args.device)
    new = next_version(old, args.density)
    delta = delta_between(old, new)
    served = {name: tensor.clone() for name, tensor in old.items()}
    with tempfile.TemporaryDirectory() as scratch:
        full_file = Path(scratch, "full.safetensors")
        delta_file = Path(scratch, "delta.safetensors")
        save_file({name: tensor.cpu() for name, tensor in new.items()}, full_file)
        delta_file.write_bytes(b"".join(encode_delta_file(delta)))

        def swap_delta() -> None:
            apply_delta(served, read_delta_file(delta_file.read_bytes(), str(delta_file)))

        def swap_full() -> None:
            for name, tensor in load_file(full_file).items():
                served[name].copy_(tensor)

        pairs = []
        for repeat in range(args.repeats):
            seconds = {}
            for swap in (swap_full, swap_delta) if repeat % 2 else (swap_delta, swap_full):
                for name, tensor in old.items():  # the served base again, untimed
                    served[name].copy_(tensor)
                seconds[swap] = timed(swap, args.device)
                if not all(torch.equal(served[name], new[name]) for name in new):
                    raise AssertionError(f"{swap.__name__} did not give the new version exactly")
            pairs.append((seconds[swap_delta], seconds[swap_full]))
        ratio = statistics.median(d / f for d, f in pairs)
        result = {
            "entries": float(sum(t.numel() for t in old.values())),
            "changed": float(delta.count),
            "delta_mb": delta_file.stat().st_size / 1e6,
            "full_mb": full_file.stat().st_size / 1e6,
            "delta_s": statistics.median(d for d, _ in pairs),
            "full_s": statistics.median(f for _, f in pairs),
            "ratio": ratio,
        }
    print(
        f"{args.device}: {result['entries'] / 1e6:.0f}M entries, {result['changed'] / 1e6:.1f}M "
        f"changed; delta {result['delta_mb']:.1f} MB in {result['delta_s']:.3f} s, full "
        f"{result['full_mb']:.0f} MB in {result['full_s']:.3f} s; ratio delta / full "
        f"{ratio:.2f}"
    )
    return result


if __name__ == "__main__":
    main()
