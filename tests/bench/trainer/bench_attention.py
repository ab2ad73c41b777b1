"""Attention kernels on the benchmark's shape: which backend the trainer should use on Hopper.

    python -m tests.bench.trainer.bench_attention

Causal bf16 attention over 2 × 8192 tokens, 16 query heads over 8 key/value heads of 128 (the
Qwen3-0.6B shape), forward + backward, each SDPA backend forced alone, and FA2 varlen on the
same tokens as two documents. TFLOP/s counts causal work: 4·S²·d·H/2 forward, 2.5× in backward.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.trainer.attention import _varlen

B, H, KV, S, D = 2, 16, 8, 8192, 128


def timed(fn, repeats: int = 10) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats / 1000


def main() -> None:
    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, KV, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, KV, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    flops = 3.5 * 4 * S * S * D * H * B / 2

    def sdpa(backend: SDPBackend):
        def run() -> None:
            with sdpa_kernel([backend]):
                kk, vv = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
                out = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=True)
            out.backward(grad)

        return run

    def varlen() -> None:
        flat = [t.transpose(1, 2).reshape(B * S, t.shape[1], D) for t in (q, k, v)]
        cu = torch.tensor([0, S, 2 * S], device="cuda", dtype=torch.int32)
        out = _varlen(*flat, cu, S, D**-0.5)
        out.backward(grad.transpose(1, 2).reshape(B * S, H, D))

    runs = {
        f"sdpa-{b.name.lower()}": sdpa(b)
        for b in (
            SDPBackend.CUDNN_ATTENTION,
            SDPBackend.FLASH_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION,
        )
    }
    runs["varlen-fa2"] = varlen
    for name, fn in runs.items():
        try:
            seconds = timed(fn)
            rate = flops / seconds / 1e12
            print(f"attention {name:20} {seconds * 1e3:7.2f} ms  {rate:6.0f} TFLOP/s")
        except Exception as exc:  # a backend may not support the shape on this build
            print(f"attention {name:20} unavailable: {str(exc).splitlines()[0][:120]}")


if __name__ == "__main__":
    main()
