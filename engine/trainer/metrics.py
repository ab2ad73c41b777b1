"""Step metrics: FLOP accounting for MFU, the bf16 peak, and where metric lines are stored.

**Storage.** Object stores cannot append, and `<run>/metrics.jsonl` has several writers (the
trainer, the orchestrator, evaluation). Rank 0 therefore writes one immutable object per step,
`<run>/metrics/<stage>/step_NNNNNN.jsonl`, holding that step's JSON line: one PUT per step on
any backend, nothing to read back or rewrite, no two writers on one object, and a crash loses at
most the line being written. `read_metrics` (or `cat <run>/metrics/*/*.jsonl` on a local run)
gives the JSONL stream; a resumed run overwrites the lines of steps it repeats.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import torch
from transformers import PretrainedConfig

from storage.layout import RunLayout
from storage.paths import join
from storage.store import ObjectStore

METRICS_DIR = "metrics"


def flops_per_token(config: PretrainedConfig, num_parameters: int, seq_len: int) -> float:
    """Training FLOPs per token: 6·N + 6·L·H·d_head·S (dense matmuls plus causal attention).

    N is every parameter once (a tied LM head is the embedding matrix, counted once), the
    convention of the issue's reference figures. S is the row length: with packed documents the
    attention really done is less, so MFU of packed rows overstates attention work.
    """
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 6 * config.num_hidden_layers * config.num_attention_heads * head_dim * seq_len
    return 6 * num_parameters + attention


def measure_bf16_peak(device: torch.device, size: int = 8192, repeats: int = 10) -> float:
    """bf16 matmul FLOP/s of this GPU, measured now on random data (the MFU denominator)."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize(device)
    seconds = start.elapsed_time(end) / 1000 / repeats
    return 2 * size**3 / seconds


def metrics_path(stage: str, step: int) -> str:
    return join(METRICS_DIR, stage, f"{RunLayout.step_name(step)}.jsonl")


def write_metrics(store: ObjectStore, stage: str, step: int, values: Mapping[str, Any]) -> None:
    """Store one step's metric line (call on rank 0 only)."""
    line = {"stage": stage, "step": step, "time": time.time(), **values}
    store.write_bytes(metrics_path(stage, step), (json.dumps(line, sort_keys=True) + "\n").encode())


def read_metrics(store: ObjectStore, stage: str) -> list[dict[str, Any]]:
    """Every stored line of `stage`, in step order."""
    lines = []
    for name in store.list(join(METRICS_DIR, stage)):
        lines.append(json.loads(store.read_bytes(join(METRICS_DIR, stage, name))))
    return sorted(lines, key=lambda line: line["step"])
