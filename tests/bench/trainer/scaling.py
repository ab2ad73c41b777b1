"""Scaling efficiency from the JSON of alternating 1-GPU and N-GPU runs of `bench_trainer`.

    python -m tests.bench.trainer.scaling one_1.json many_1.json [one_2.json many_2.json ...]

Each pair's efficiency is N-GPU tokens/s ÷ (N × 1-GPU tokens/s); runs alternate so that a slow
spell of the machine lands on both sides. The median over pairs is the figure to report.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def efficiency(one: dict, many: dict) -> float:
    return many["tokens_per_second"] / (many["gpus"] * one["tokens_per_second"])


def describe(run: dict) -> str:
    return (
        f"{run['gpus']} GPU(s) {run['tokens_per_second']:,.0f} tok/s, {run['mfu']:.1%} MFU, "
        f"{run['peak_memory_gib']:.1f} GiB"
    )


def main(paths: list[str]) -> None:
    if not paths or len(paths) % 2:
        raise SystemExit("give pairs of JSON files: 1-GPU run, then N-GPU run")
    runs = []
    for path in paths:
        result = json.loads(Path(path).read_text())
        runs.append({**result["primeflow"], "gpus": result["gpus"], "shape": result["shape"]})
    values = []
    for index in range(0, len(runs), 2):
        one, many = runs[index], runs[index + 1]
        values.append(efficiency(one, many))
        print(f"pair {index // 2 + 1}: {describe(one)}; {describe(many)}; {values[-1]:.1%}")
    print(f"Qwen3-{runs[0]['shape']}: median scaling efficiency {statistics.median(values):.1%}")


if __name__ == "__main__":
    main(sys.argv[1:])
