"""What publishing the policy costs a training step: a policy version against today's per-step
checkpoint and a plain safetensors save, on Qwen3-0.6B- / 1.7B-shaped models, in one process.

    python -m tests.bench.trainer.bench_publish --shape 0.6b --out publish-0.6b.json   # one GPU
    python -m tests.bench.trainer.bench_publish --shape tiny --steps 3                   # CPU

Per step, with a real training step (`--train-tokens` in rows of 8192, FSDP2, bf16 compute,
fp32 masters, AdamW) between publications, into a `file://` run root on local disk:

- `checkpoint`: a resume checkpoint written while training waits, what every RL step wrote
  before issue 14 (fp32 weights, AdamW moments, RNG; gathered to rank 0, written by it).
- `resume`: the same checkpoint as the trainer writes it now (`CheckpointWriter`: snapshot to
  pinned host memory, written and committed in the background while the next step trains).
- `policy`: `PolicyPublisher.publish` with every version full (snapshot in the serving dtype,
  written and committed in the background while the next step trains): its stall (waiting for
  the previous publication + the snapshot) and bytes.
- `delta`: the same with deltas (one full version, then exact deltas against the version
  before): the median stall and bytes of the delta versions, and the fraction of entries that
  changed per step (AdamW, lr 1e-6, as in RL).
- `safetensors`: the gathered bf16 state dict saved with `safetensors.torch.save_file`,
  synchronously (the plain baseline).

Bytes per version are the committed files' sizes. Ratios: each stall over the training step,
each version's bytes over the bf16 weights.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import Qwen3Config

from engine.config.trainer import (
    CheckpointConfig,
    ConstantSchedulerConfig,
    OptimizerConfig,
    PolicyConfig,
)
from engine.trainer.batching import micro_batches
from engine.trainer.checkpoint_state import model_tensors, tied_head_key
from engine.trainer.checkpoint_writer import CheckpointWriter
from engine.trainer.distributed import DistInfo, close_distributed, init_distributed
from engine.trainer.loss import sft_loss
from engine.trainer.model import ModelOptions, build_policy, causal_lm_from_config
from engine.trainer.optim import build_optimizer
from engine.trainer.packing import Sample, pack_samples
from engine.trainer.publish import PolicyPublisher
from engine.trainer.schedule import build_scheduler
from engine.trainer.snapshot import snapshot_weights
from engine.trainer.step import StepContext, train_step
from storage.commit import read_commit
from storage.layout import RunLayout
from storage.store import ObjectStore
from tests.bench.e2e.bench_async import emit
from tests.bench.trainer.bench_trainer import SHAPES, qwen3_config

ROW = 8192


def model_config(shape: str) -> Qwen3Config:
    """A published Qwen3 shape, or `tiny` (2 layers of 256) to try the bench on a CPU."""
    if shape in SHAPES:
        return qwen3_config(shape)
    return Qwen3Config(
        vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
    )  # fmt: skip


def documents(rows: int, vocab: int, step: int) -> list[Sample]:
    """`rows` documents of one full row each, random tokens (the step's cost, not its data)."""
    rng = np.random.default_rng(step)
    return [
        Sample(
            token_ids=rng.integers(0, vocab, ROW),
            loss_mask=np.ones(ROW, dtype=bool),
            logprobs=np.zeros(ROW, dtype=np.float32),
        )
        for _ in range(rows)
    ]


def committed_bytes(store: ObjectStore, step_dir: str) -> int:
    return sum(digest.size for digest in read_commit(store, step_dir).files.values())


def timed(action: Callable[[], Any]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def run(args: argparse.Namespace, dist: DistInfo) -> dict[str, Any]:
    config = model_config(args.shape)
    on_gpu = dist.device.type == "cuda"
    compute = torch.bfloat16 if on_gpu else torch.float32
    policy = build_policy(
        causal_lm_from_config(config), dist.mesh, dist.device, ModelOptions(compute_dtype=compute)
    )
    policy.config.dtype = "bfloat16"  # the serving dtype, as Qwen3's published config says
    ctx = StepContext(policy=policy, dist=dist, compute_dtype=compute)
    optimizer = build_optimizer(policy, OptimizerConfig(lr=1e-6), dist.device)
    scheduler = build_scheduler(optimizer, ConstantSchedulerConfig(), 1000)
    rows = max(1, args.train_tokens // ROW)

    def train(index: int) -> float:
        packed = pack_samples(documents(rows, config.vocab_size, index), ROW)
        batches = micro_batches(packed, 2)
        tokens = int(packed.loss_mask.sum())
        return train_step(ctx, optimizer, scheduler, batches, sft_loss, tokens, 1.0)["step_seconds"]

    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench-publish-"))
    train(0)  # warm-up; AdamW has its moments from here on
    results: dict[str, Any] = {"shape": args.shape, "device": str(dist.device)}

    def checkpoint_steps(name: str, background: bool) -> dict[str, Any]:
        """Train and checkpoint `args.steps` times, in the background or waiting for each.

        In the background the stall is the snapshot alone: the wait for the previous write is
        timed apart (`wait_s`), since the bench checkpoints every step and the trainer every
        `checkpoint.interval` (default 10).
        """
        store = ObjectStore(f"file://{root}/{name}")
        writer = CheckpointWriter(
            store, policy, optimizer, scheduler, dist, files={},
            config=CheckpointConfig(keep_last=1),
        )  # fmt: skip
        stalls, waits = [], []
        for step in range(1, args.steps + 1):
            train_s.append(train(step))
            waits.append(timed(writer.flush))
            stalls.append(timed(lambda step=step: writer.save(step, {})))
            if not background:
                stalls[-1] += timed(writer.flush)
        last_write = timed(writer.flush)
        size = committed_bytes(store, RunLayout.checkpoint_dir(args.steps))
        shutil.rmtree(root / name, ignore_errors=True)  # a 1.7B checkpoint is 20 GB
        return {
            "stall_s": statistics.median(stalls),
            "wait_s": statistics.median(waits),
            "last_write_s": last_write,
            "bytes": size,
        }

    train_s: list[float] = []
    results["checkpoint"] = checkpoint_steps("checkpoint", background=False)
    results["resume"] = checkpoint_steps("resume", background=True)

    def publish_steps(name: str, full_every: int) -> dict[str, Any]:
        """Train and publish `args.steps` versions; the stall and bytes of each kind."""
        store = ObjectStore(f"file://{root}/{name}")
        publisher = PolicyPublisher(
            store, policy, optimizer, dist,
            config=PolicyConfig(keep_last=2, full_every=full_every),
            files={}, lineage=0,
        )  # fmt: skip
        stalls: dict[bool, list[float]] = {True: [], False: []}
        sizes: dict[bool, list[int]] = {True: [], False: []}
        changed, waits, kinds = [], [], []
        for step in range(1, args.steps + 1):
            train_s.append(train(step))
            cost = publisher.publish(step)  # returns once version step - 1 is committed
            kinds.append(bool(cost["policy_full"]))
            stalls[kinds[-1]].append(
                cost["publish_wait_seconds"] + cost["publish_snapshot_seconds"]
            )
            waits.append(cost["publish_wait_seconds"])
            changed.append(cost["policy_changed_fraction"])
            if step > 1:
                sizes[kinds[-2]].append(committed_bytes(store, RunLayout.policy_dir(step - 1)))
        last_write = timed(publisher.flush)
        sizes[kinds[-1]].append(committed_bytes(store, RunLayout.policy_dir(args.steps)))
        shutil.rmtree(root / name, ignore_errors=True)
        kind = "delta" if stalls[False] else "full"
        return {
            "stall_s": statistics.median(stalls[kind == "full"]),
            "wait_s": statistics.median(waits),
            "last_write_s": last_write,
            "bytes": statistics.median(sizes[kind == "full"]),
            "changed_fraction": statistics.median(changed[1:] or changed),
            "full_versions": len(sizes[True]),
            "full_stall_s": statistics.median(stalls[True]) if stalls[True] else None,
        }

    results["policy"] = publish_steps("policy", full_every=1)
    results["delta"] = publish_steps("delta", full_every=args.steps + 1)

    stalls = []
    for step in range(1, args.steps + 1):
        train_s.append(train(step))
        path = root / f"plain-{step}.safetensors"

        def plain(path: Path = path) -> None:
            weights, fence = snapshot_weights(model_tensors(policy), torch.bfloat16, dist)
            fence.wait()
            if dist.is_main:
                save_file(weights, str(path))

        stalls.append(timed(plain))
    results["safetensors"] = {
        "stall_s": statistics.median(stalls),
        "bytes": (root / f"plain-{args.steps}.safetensors").stat().st_size,
    }

    step_s = statistics.median(train_s)
    results["train_step_s"] = step_s
    results["train_tokens"] = rows * ROW
    results["bf16_weight_bytes"] = 2 * sum(
        p.numel() for n, p in policy.state_dict().items() if n != tied_head_key(policy)
    )
    for name in ("checkpoint", "resume", "policy", "delta", "safetensors"):
        results[name]["stall_over_step"] = results[name]["stall_s"] / step_s
    for name in ("policy", "delta"):
        results[name]["bytes_over_bf16"] = results[name]["bytes"] / results["bf16_weight_bytes"]
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.trainer.bench_publish")
    parser.add_argument("--shape", choices=[*SHAPES, "tiny"], default="0.6b")
    parser.add_argument("--steps", type=int, default=5, help="publications per method")
    parser.add_argument("--train-tokens", type=int, default=65536, help="tokens per step")
    parser.add_argument("--workdir", default=None, help="run roots go here (local disk)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    dist = init_distributed("auto")
    try:
        result = run(args, dist)
    finally:
        close_distributed()
    if dist.is_main:
        emit(result, args.out)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
