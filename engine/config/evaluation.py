"""Evaluation of a checkpoint (or the live pool) on environments' eval splits."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from engine.config.base import BaseConfig
from engine.config.orchestrator import EnvConfig, SamplingConfig


class EvalConfig(BaseConfig):
    """avg@k and pass@k over held-out examples, written under `<run>/eval/`."""

    envs: Annotated[
        list[EnvConfig], Field(min_length=1, description="Environments to evaluate.")
    ] = [EnvConfig()]
    num_examples: Annotated[int, Field(ge=1, description="Held-out examples per environment.")] = (
        200
    )
    rollouts_per_example: Annotated[int, Field(ge=1, description="k in avg@k and pass@k.")] = 1
    sampling: SamplingConfig = SamplingConfig()
    greedy: Annotated[bool, Field(description="Also report temperature-0 results.")] = True
    checkpoint_step: Annotated[
        int | None, Field(ge=0, description="Checkpoint to evaluate; None: the latest committed.")
    ] = None
