"""Trainer throughput on Qwen3-0.6B- (or 1.7B-) shaped models with random weights, vs plain HF.

    python -m tests.bench.trainer.bench_trainer                       # one GPU, all variants
    torchrun --nproc-per-node 2 -m tests.bench.trainer.bench_trainer --variants primeflow
    python -m tests.bench.trainer.bench_trainer --shape 1.7b --variants primeflow
    python -m tests.bench.trainer.bench_trainer --variants primeflow,primeflow-lora   # LoRA

Every variant trains on 2 rows × 8192 tokens per GPU per step in bf16, after warm-up steps,
each in a fresh process (so no variant reuses another's compiled code or memory pool).
MFU = tokens/s × (6·N + 6·L·H·d_head·S) ÷ (bf16 matmul peak measured in this run × GPUs).

- `plain`: the baseline the issue defines: `model(input_ids, labels=input_ids)`, SDPA, AdamW,
  bf16 parameters, one process, no FSDP.
- `primeflow`: the trainer's own path (FSDP2 with bf16 compute and fp32 masters and reduction,
  compiled blocks, chunked LM-head log-probs, fused AdamW) through `engine.trainer.step`, on
  rows that each hold one 8192-token document (the same attention work as `plain`).
- `primeflow-flash`: the same with SDPA forced to FlashAttention-2 (instead of cuDNN first).
- `primeflow-eager`: the same without `torch.compile`.
- `primeflow-packed`: rows packed from documents of 256-4096 tokens (FA2 varlen); real
  attention work is lower than the formula's, so its MFU is nominal.

With `PRIMEFLOW_BENCH_PROFILE=DIR`, the `primeflow*` variants profile two more steps after the
timed ones and write `DIR/<variant>_rank<r>.json` (Chrome traces) and a kernel breakdown
(`tests.bench.trainer.trace_summary`) to stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM, Qwen3Config

from engine.config.trainer import ConstantSchedulerConfig, LoraConfig, OptimizerConfig
from engine.trainer import attention as attention_module
from engine.trainer import step as step_module
from engine.trainer.batching import micro_batches, rank_share
from engine.trainer.distributed import DistInfo, close_distributed, init_distributed
from engine.trainer.loss import sft_loss
from engine.trainer.metrics import flops_per_token, measure_bf16_peak
from engine.trainer.model import ModelOptions, build_policy, causal_lm_from_config
from engine.trainer.optim import build_optimizer
from engine.trainer.packing import Sample, pack_samples
from engine.trainer.schedule import build_scheduler
from engine.trainer.step import StepContext, train_step
from tests.bench.trainer.trace_summary import summarise

SEQ_LEN = 8192
ROWS = 2
WARMUP = 3
STEPS = 10


# Published Qwen3 widths (28 layers, 16/8 heads of 128, vocab 151,936, tied head in both).
SHAPES = {"0.6b": (1024, 3072), "1.7b": (2048, 6144)}


def qwen3_config(shape: str) -> Qwen3Config:
    """A Qwen3 model's published shape: `shape` picks hidden and MLP widths from `SHAPES`."""
    hidden, intermediate = SHAPES[shape]
    return Qwen3Config(
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1_000_000,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def plain_hf(device: torch.device, config: Qwen3Config) -> dict[str, float]:
    """The baseline loop, timed with a host clock after synchronising."""
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.bfloat16, attn_implementation="sdpa"
    ).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, 151936, (ROWS, SEQ_LEN), device=device)
    times = []
    for index in range(WARMUP + STEPS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if index >= WARMUP:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30
    num_parameters = sum(p.numel() for p in model.parameters())
    del model, optimizer, loss
    free_memory()
    seconds = float(np.median(times))
    return {
        "tokens_per_second": ROWS * SEQ_LEN / seconds,
        "step_seconds": seconds,
        "peak_memory_gib": peak,
        "num_parameters": num_parameters,
    }


def documents(packed: bool, rank: int, step: int) -> list[Sample]:
    """Per-rank samples of one step: 2 full-row documents, or enough short ones to fill 2 rows."""
    rng = np.random.default_rng([rank, step])
    if packed:
        lengths, total = [], 0
        while total < ROWS * SEQ_LEN - SEQ_LEN // 2:
            lengths.append(int(rng.integers(SEQ_LEN // 32, SEQ_LEN // 2 + 1)))
            total += lengths[-1]
    else:
        lengths = [SEQ_LEN] * ROWS
    return [
        Sample(
            token_ids=rng.integers(0, 151936, n),
            loss_mask=np.ones(n, dtype=bool),
            logprobs=np.zeros(n, dtype=np.float32),
        )
        for n in lengths
    ]


def primeflow(
    dist: DistInfo,
    peak: float,
    config: Qwen3Config,
    *,
    compile: bool,
    packed: bool,
    backend: str | None = None,
    lora: LoraConfig | None = None,
) -> dict[str, float]:
    """The trainer's step on this rank's rows; metrics are over all ranks."""
    options = ModelOptions(compute_dtype=torch.bfloat16, compile=compile, lora=lora)
    causal_lm = causal_lm_from_config(config)
    num_parameters = sum(p.numel() for p in causal_lm.parameters())
    policy = build_policy(causal_lm, dist.mesh, dist.device, options)
    ctx = StepContext(
        policy=policy,
        dist=dist,
        compute_dtype=torch.bfloat16,
        flops_per_token=flops_per_token(policy.config, num_parameters, SEQ_LEN),
        peak_flops=peak,
    )
    optimizer = build_optimizer(policy, OptimizerConfig(lr=1e-5), dist.device)
    scheduler = build_scheduler(optimizer, ConstantSchedulerConfig(), WARMUP + STEPS)
    original: Callable[..., Any] = step_module.sdpa_priority
    if backend is not None:
        step_module.sdpa_priority = lambda device: sdpa_kernel([getattr(SDPBackend, backend)])

    def step(index: int) -> dict[str, float]:
        # Each rank packs its own documents: this measures the step, not data movement.
        rows = pack_samples(documents(packed, dist.rank, index), SEQ_LEN)
        share = rank_share(rows, 0, 1, ROWS)
        batches = micro_batches(share.select(range(ROWS)), ROWS)
        # Ranks draw different documents; the normaliser only scales gradients, not time.
        loss_tokens = int(share.loss_mask[:ROWS].sum()) * dist.world_size
        return train_step(ctx, optimizer, scheduler, batches, sft_loss, loss_tokens, 1.0)

    try:
        results = []
        for index in range(WARMUP + STEPS):
            metrics = step(index)
            if index >= WARMUP:
                results.append(metrics)
        profile_dir = os.environ.get("PRIMEFLOW_BENCH_PROFILE")
        if profile_dir:
            name = "primeflow" + ("-packed" if packed else "") + ("" if compile else "-eager")
            trace = Path(profile_dir) / f"{name}_rank{dist.rank}.json"
            profile_steps(lambda index: step(WARMUP + STEPS + index), trace)
    finally:
        step_module.sdpa_priority = original
    return {
        "tokens_per_second": float(np.median([m["tokens_per_second"] for m in results])),
        "step_seconds": float(np.median([m["step_seconds"] for m in results])),
        "peak_memory_gib": max(m.get("peak_memory_gib", 0.0) for m in results),
        "loss_last": results[-1]["loss"],
        "num_parameters": num_parameters,
    }


def profile_steps(step: Callable[[int], object], trace: Path, steps: int = 2) -> None:
    """Run `steps` steps under the torch profiler; write the trace and print its breakdown."""
    from torch.profiler import ProfilerActivity, profile

    trace.parent.mkdir(parents=True, exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        for index in range(steps):
            step(index)
    profiler.export_chrome_trace(str(trace))
    print(summarise(trace), flush=True)


VARIANTS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "primeflow": {"compile": True, "packed": False},
    "primeflow-flash": {"compile": True, "packed": False, "backend": "FLASH_ATTENTION"},
    "primeflow-eager": {"compile": False, "packed": False},
    "primeflow-packed": {"compile": True, "packed": True},
    # LoRA rank 16 on every projection (its MFU still counts 6N: the base's weight gradients it
    # skips are what it saves).
    "primeflow-lora": {"compile": True, "packed": False, "lora": LoraConfig(rank=16, alpha=32.0)},
}


def run_isolated(names: list[str], shape: str) -> dict[str, Any]:
    """Each variant in its own process; their JSON results merged."""
    merged: dict[str, Any] = {}
    for name in names:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            command = [sys.executable, "-m", __spec__.name, "--variants", name, "--shape", shape]
            command += ["--json", out.name]
            if subprocess.run(command).returncode == 0:
                merged.update(json.loads(Path(out.name).read_text()))
            else:
                merged[name] = {"error": "process failed"}
    return merged


def print_table(results: dict[str, Any]) -> None:
    base = results.get("plain", {}).get("tokens_per_second")
    peak = results["bf16_peak_tflops"]
    shape, gpus, device = results["shape"], results["gpus"], results["device"]
    print(f"\nQwen3-{shape} shape, {gpus} GPU(s) {device}, bf16 peak {peak:.0f} TF/s")
    print(f"{'variant':18} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} {'vs plain':>9}")
    for name in VARIANTS:
        r = results.get(name)
        if not r or "error" in r:
            print(f"{name:18} {'failed' if r else 'skipped'}")
            continue
        ratio = f"{r['tokens_per_second'] / base:.2f}x" if base else "-"
        print(
            f"{name:18} {r['tokens_per_second']:10.0f} {r['mfu']:6.1%} "
            f"{r['peak_memory_gib']:9.1f} {ratio:>9}"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--shape", default="0.6b", choices=sorted(SHAPES))
    parser.add_argument("--json", default=None, help="write results here (rank 0)")
    args = parser.parse_args()
    names = args.variants.split(",")
    if len(names) > 1 and "WORLD_SIZE" not in os.environ:
        results = run_isolated(names, args.shape)
        print_table(results)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(results, handle, indent=2)
        return
    dist = init_distributed("nccl")
    peak = measure_bf16_peak(dist.device)
    config = qwen3_config(args.shape)
    attention_flops = flops_per_token(config, 0, SEQ_LEN)  # N = 0: the attention term
    results: dict[str, Any] = {
        "shape": args.shape,
        "gpus": dist.world_size,
        "device": torch.cuda.get_device_name(dist.device),
        "torch": torch.__version__,
        "varlen": attention_module.varlen_attn is not None,
        "bf16_peak_tflops": peak / 1e12,
    }
    for name in names:
        try:
            variant = VARIANTS[name]
            if variant is None:
                result = plain_hf(dist.device, config)
            else:
                result = primeflow(dist, peak, config, **variant)
            per_token = attention_flops + 6 * result["num_parameters"]
            result["mfu"] = result["tokens_per_second"] * per_token / (peak * dist.world_size)
            results[name] = result
        except Exception:  # one broken variant must not cost the others' numbers
            results[name] = {"error": traceback.format_exc(limit=6)}
        free_memory()  # the variant's model and optimizer went out of scope with it
        if dist.is_main:
            print(name, json.dumps(results[name]), flush=True)
    if dist.is_main:
        print_table(results)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(results, handle, indent=2)
    close_distributed()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
