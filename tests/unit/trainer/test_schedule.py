"""LR schedules: warmup, then constant, linear or cosine reaching min_lr_ratio at the last step."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from engine.config.trainer import (
    ConstantSchedulerConfig,
    CosineSchedulerConfig,
    LinearSchedulerConfig,
)
from engine.trainer.schedule import build_scheduler, lr_factor


def test_warmup_then_constant() -> None:
    config = ConstantSchedulerConfig(warmup_steps=4)
    assert [lr_factor(s, 10, config) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("kind", [LinearSchedulerConfig, CosineSchedulerConfig])
def test_decay_reaches_min_at_last_step(kind: type) -> None:
    config = kind(warmup_steps=2, min_lr_ratio=0.1)
    factors = [lr_factor(s, 12, config) for s in range(12)]
    assert factors[:3] == [0.5, 1.0, 1.0]
    assert factors[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(factors[2:]))


def test_cosine_midpoint_and_linear_midpoint() -> None:
    # 11 steps, no warmup: step 5 is half way.
    assert lr_factor(5, 11, CosineSchedulerConfig()) == pytest.approx(0.5)
    assert lr_factor(5, 11, LinearSchedulerConfig()) == pytest.approx(0.5)
    assert lr_factor(2, 11, CosineSchedulerConfig()) == pytest.approx(
        0.5 * (1 + math.cos(math.pi * 0.2))
    )


def test_scheduler_drives_optimizer_lr() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    optim = torch.optim.AdamW([param], lr=1.0)
    scheduler = build_scheduler(optim, LinearSchedulerConfig(warmup_steps=1), total_steps=3)
    seen = []
    for _ in range(3):
        seen.append(optim.param_groups[0]["lr"])
        optim.step()
        scheduler.step()
    assert seen == pytest.approx([1.0, 1.0, 0.0])
