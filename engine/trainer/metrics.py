"""Step metrics: FLOP accounting for MFU and the bf16 peak (lines are stored by
`storage.metrics`)."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig


def flops_per_token(config: PretrainedConfig, num_parameters: int, seq_len: int) -> float:
    """Training FLOPs per token: 6·N + 6·L·H·d_head·S (dense matmuls plus causal attention).

    N is every parameter once (a tied LM head is the embedding matrix, counted once), the
    convention of the issue's reference figures. S is the row length: with packed documents the
    attention really done is less, so MFU of packed rows overstates attention work.
    """
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 6 * config.num_hidden_layers * config.num_attention_heads * head_dim * seq_len
    return float(6 * num_parameters + attention)


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
    seconds = float(start.elapsed_time(end)) / 1000 / repeats
    return 2 * size**3 / seconds
