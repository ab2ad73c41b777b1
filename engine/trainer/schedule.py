"""Learning-rate schedules: linear warmup, then constant, linear or cosine decay.

`lr_factor` is the whole schedule as a pure function of the step, so it is tested directly and a
resumed run recomputes exactly the lr it would have had: the scheduler holds no state beyond
the step counter that the trainer state already saves.
"""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from engine.config.trainer import (
    CosineSchedulerConfig,
    LinearSchedulerConfig,
    SchedulerConfig,
)


def lr_factor(step: int, total_steps: int, config: SchedulerConfig) -> float:
    """Multiplier of the peak lr for 0-based optimizer step `step` of `total_steps`.

    Warmup rises linearly to 1 over `warmup_steps` steps (step 0 gets 1/warmup, never 0, so no
    step is wasted); decay then reaches `min_lr_ratio` exactly at the last step.
    """
    warmup = config.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if not isinstance(config, LinearSchedulerConfig | CosineSchedulerConfig):
        return 1.0
    span = max(1, total_steps - 1 - warmup)
    progress = min(1.0, (step - warmup) / span)
    if isinstance(config, LinearSchedulerConfig):
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * decay


def build_scheduler(optimizer: Optimizer, config: SchedulerConfig, total_steps: int) -> LambdaLR:
    """A `LambdaLR` over `lr_factor`; its `last_epoch` is the number of steps already taken."""
    return LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, config))
