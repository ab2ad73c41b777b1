"""Evaluation of a checkpoint (or the live pool) on environments' eval splits."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from engine.config.base import BaseConfig
from engine.config.orchestrator import EnvConfig, SamplingConfig, check_unique_labels


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
        int | None,
        Field(
            ge=0,
            description="Checkpoint `primeflow evaluate` takes; 0: the model itself; None: the "
            "newest committed.",
        ),
    ] = None
    stage: Annotated[
        Literal["rl", "sft"],
        Field(
            description="Whose checkpoints `primeflow evaluate` takes: RL's (`<run>/checkpoints`) "
            "or SFT's (`<run>/sft`)."
        ),
    ] = "rl"
    name: Annotated[
        str | None,
        Field(min_length=1, description="Results go to `<run>/eval/<name>/`; None: the stage."),
    ] = None
    pass_threshold: Annotated[
        float | None,
        Field(description="Reward that counts as solved for pass@k; None: each env's own."),
    ] = None
    max_concurrent: Annotated[int, Field(ge=1, description="In-flight rollout requests.")] = 64
    interval: Annotated[
        int | None,
        Field(
            ge=1,
            description="During RL, evaluate the served policy on these held-out examples "
            "every N policy versions (and version 0), greedy and sampled as set here: the "
            "`eval-online` metric lines, the UI's metrics table and the report's curve. "
            "None: only the pipeline's evaluations.",
        ),
    ] = None
    interval_examples: Annotated[
        int | None,
        Field(ge=1, description="Held-out examples per evaluation during RL; None: num_examples."),
    ] = None

    @model_validator(mode="after")
    def _env_labels_are_unique(self) -> EvalConfig:
        check_unique_labels(self.envs)
        return self
