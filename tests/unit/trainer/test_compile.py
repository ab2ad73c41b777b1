"""Compiled blocks compile once: packed steps of any row count reuse the first graph.

A step's row count follows how many tokens it sampled; a graph compiled for the first count
would be compiled again when it changes, mid-run (7-10 s on an H200). Real inductor on the
CPU, so this costs ~20 s.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch._dynamo.utils import counters

from engine.config.trainer import ConstantSchedulerConfig, OptimizerConfig
from engine.trainer.batching import micro_batches
from engine.trainer.distributed import init_distributed
from engine.trainer.loss import sft_loss
from engine.trainer.model import ModelOptions, build_policy, compute_dtype, load_causal_lm
from engine.trainer.optim import build_optimizer
from engine.trainer.packing import Sample, pack_samples
from engine.trainer.schedule import build_scheduler
from engine.trainer.step import StepContext, train_step

SEQ_LEN = 64


def test_compiled_blocks_train_every_row_count_on_one_graph(tiny_model_dir: Path) -> None:
    torch._dynamo.reset()
    counters.clear()
    dist = init_distributed("gloo")
    dtype = compute_dtype("auto", dist.device)
    options = ModelOptions(compute_dtype=dtype, compile=True)
    policy = build_policy(
        load_causal_lm(str(tiny_model_dir), options), dist.mesh, dist.device, options
    )
    ctx = StepContext(policy=policy, dist=dist, compute_dtype=dtype)
    optimizer = build_optimizer(policy, OptimizerConfig(lr=1e-2), dist.device)
    scheduler = build_scheduler(optimizer, ConstantSchedulerConfig(), 10)
    rng = np.random.default_rng(0)
    row_counts = []
    for lengths in [(30, 20, 40), (50, 60, 10, 33, 7), (20,) * 10]:
        samples = [
            Sample(rng.integers(0, 100, n), np.ones(n, bool), np.zeros(n, np.float32))
            for n in lengths
        ]
        rows = pack_samples(samples, SEQ_LEN)
        row_counts.append(len(rows.loss_mask))
        metrics = train_step(
            ctx,
            optimizer,
            scheduler,
            micro_batches(rows, 8),
            sft_loss,
            int(rows.loss_mask.sum()),
            1.0,
        )
        assert np.isfinite(metrics["loss"])
    assert len(set(row_counts)) == 3, row_counts
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
