"""Where a profiled GPU step's time went, from a torch profiler Chrome trace.

    python -m tests.bench.trainer.trace_summary trace_rank0.json [trace_rank1.json ...]

Kernels are sorted into communication (NCCL), matmul, attention and the rest (fused
elementwise, copies, casts). The window runs from the first kernel to the last; "GPU idle" is
the part of it where no compute kernel runs, which is what a rank loses to exposed
communication, host synchronisation and launch gaps.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

CATEGORIES = {
    "communication": ("nccl",),
    "matmul": ("gemm", "nvjet", "cutlass", "xmma", "sm90_"),
    "attention": ("flash", "fmha", "cudnn", "attn"),
}


def category(name: str) -> str:
    lowered = name.lower()
    for label, needles in CATEGORIES.items():
        if any(needle in lowered for needle in needles):
            return label
    return "other"


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by [start, end) intervals (µs)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def summarise(trace: Path, top: int = 12) -> str:
    events = json.loads(trace.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        return f"{trace}: no kernels"
    window = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    by_category: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    compute: list[tuple[float, float]] = []
    comm: list[tuple[float, float]] = []
    for event in kernels:
        label = category(event["name"])
        by_category[label] += event["dur"]
        by_name[event["name"][:90]] += event["dur"]
        span = (event["ts"], event["ts"] + event["dur"])
        (comm if label == "communication" else compute).append(span)
    busy = union_length(compute)
    both = busy + union_length(comm) - union_length(compute + comm)
    lines = [
        f"{trace.name}: window {window / 1e3:.1f} ms, compute busy {busy / 1e3:.1f} ms, "
        f"GPU idle {(window - busy) / 1e3:.1f} ms, communication overlapping compute "
        f"{both / 1e3:.1f} ms",
        "  " + ", ".join(f"{k} {v / 1e3:.1f} ms" for k, v in sorted(by_category.items())),
    ]
    for name, total in sorted(by_name.items(), key=lambda item: -item[1])[:top]:
        lines.append(f"  {total / 1e3:8.2f} ms  {name}")
    return "\n".join(lines)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(summarise(Path(path)))
