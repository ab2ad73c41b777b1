"""AdamW over the sharded parameters (fused kernels on GPU), with decay on matrices only."""

from __future__ import annotations

import torch
from torch.optim import AdamW

from engine.config.trainer import OptimizerConfig
from engine.trainer.model import PolicyModel


def build_optimizer(policy: PolicyModel, config: OptimizerConfig, device: torch.device) -> AdamW:
    """AdamW with weight decay on ≥2-D weights; norms and biases are not decayed (they are scales
    and offsets, and shrinking them towards 0 only fights the data)."""
    params = [p for _, p in policy.trainable()]
    matrices = [p for p in params if p.ndim >= 2]
    vectors = [p for p in params if p.ndim < 2]
    beta1, beta2 = config.betas  # the config holds exactly two
    return AdamW(
        [
            {"params": matrices, "weight_decay": config.weight_decay},
            {"params": vectors, "weight_decay": 0.0},
        ],
        lr=config.lr,
        betas=(beta1, beta2),
        eps=config.eps,
        fused=device.type == "cuda",
    )
