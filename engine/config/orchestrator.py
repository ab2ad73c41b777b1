"""The orchestrator: environments, sampling, advantages, filters and the async bound
(docs/algorithms.md, docs/environments.md)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from engine.config.base import DEFAULT_MAX_STEPS, DEFAULT_SEQ_LEN, BaseConfig
from engine.config.model import TINY_MODEL
from engine.config.plugin import CustomPluginConfig


class SamplingConfig(BaseConfig):
    """How the inference pool samples completions."""

    temperature: Annotated[float, Field(ge=0, description="Sampling temperature; 0 is greedy.")] = (
        1.0
    )
    top_p: Annotated[float, Field(gt=0, le=1, description="Nucleus sampling mass.")] = 1.0
    max_tokens: Annotated[
        int, Field(ge=1, description="Most tokens per completion (per turn).")
    ] = 128
    stop: Annotated[list[str], Field(description="Strings that end a completion.")] = []


class EnvConfig(BaseConfig):
    """One environment: a built-in id or an installed `verifiers` environment package."""

    id: Annotated[
        str,
        Field(
            min_length=1, description="reverse-text, alphabet-sort, arithmetic, or a package id."
        ),
    ] = "reverse-text"
    name: Annotated[
        str | None,
        Field(
            min_length=1,
            description="Label in shards and metrics; None: the id. Needed to mix one id twice.",
        ),
    ] = None
    args: Annotated[
        dict[str, Any], Field(description="Keyword arguments for `load_environment`.")
    ] = {}
    ratio: Annotated[
        float, Field(gt=0, description="Share of the trained samples (normalised).")
    ] = 1.0
    sampling: Annotated[
        SamplingConfig | None, Field(description="Per-environment sampling; None: the default.")
    ] = None


def check_unique_labels(envs: list[EnvConfig]) -> None:
    labels = [env.name or env.id for env in envs]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(
            f"environment {repeated[0]!r} appears more than once; give each entry its own `name`"
        )


class GroupRelativeAdvantageConfig(BaseConfig):
    """Reward minus the group mean; optionally divided by the group std."""

    type: Literal["group_relative"] = "group_relative"
    std_normalize: Annotated[bool, Field(description="Divide by the group reward std.")] = False
    length_penalty: Annotated[
        float, Field(ge=0, description="Subtract this × completion length / max_tokens.")
    ] = 0.0


AdvantageConfig = Annotated[
    GroupRelativeAdvantageConfig | CustomPluginConfig, Field(discriminator="type")
]


class ZeroAdvantageFilterConfig(BaseConfig):
    """Drop samples whose advantage is zero: they carry no gradient."""

    type: Literal["zero_advantage"] = "zero_advantage"


class DifficultyFilterConfig(BaseConfig):
    """Online difficulty filtering: drop groups whose rewards are all equal."""

    type: Literal["difficulty"] = "difficulty"


FilterConfig = Annotated[
    ZeroAdvantageFilterConfig | DifficultyFilterConfig | CustomPluginConfig,
    Field(discriminator="type"),
]


class OrchestratorConfig(BaseConfig):
    """The RL data plane: rollouts → scored groups → advantages → one shard set per step."""

    model: Annotated[
        str, Field(description="Tokenizer/chat template; filled from `model.name`.")
    ] = TINY_MODEL
    seq_len: Annotated[
        int, Field(ge=16, description="Prompt + completion limit; filled from `seq_len`.")
    ] = DEFAULT_SEQ_LEN
    max_steps: Annotated[
        int, Field(ge=1, description="RL steps; filled from the shared `max_steps`.")
    ] = DEFAULT_MAX_STEPS
    envs: Annotated[list[EnvConfig], Field(min_length=1, description="Training environments.")] = [
        EnvConfig()
    ]
    batch_size: Annotated[int, Field(ge=1, description="Samples (or tokens) per step.")] = 128
    batch_unit: Annotated[
        Literal["samples", "tokens"], Field(description="What `batch_size` counts.")
    ] = "samples"
    rollouts_per_example: Annotated[
        int, Field(ge=1, description="Samples per prompt; they form one group.")
    ] = 8
    max_async_level: Annotated[
        int,
        Field(
            ge=0,
            description="Rollouts for batch n start from policy ≥ n-1-this; 0 is synchronous "
            "on-policy. A rollout that outlives its batch lands in a later one, so a batch can "
            "hold groups further behind (up to max_off_policy_steps), each token weighed by "
            "the importance ratio of the policy that sampled it.",
        ),
    ] = 1
    max_off_policy_steps: Annotated[
        int,
        Field(
            ge=0,
            description="Drop a group once its oldest token is more than this many versions "
            "behind the weights that train on it (version n-1 for batch n): the limit for "
            "rollouts that outlive their batch. Equal to max_async_level, every batch keeps "
            "to the async bound exactly.",
        ),
    ] = 8
    max_concurrent: Annotated[
        int,
        Field(
            ge=1,
            description="In-flight rollout requests, at most: no more start than the batches "
            "within the async bound still lack.",
        ),
    ] = 64
    launch_margin_sd: Annotated[
        float,
        Field(
            ge=0,
            description="Standard deviations of margin when starting groups for batches a "
            "filter drops groups from: a batch rarely waits a whole rollout for a group it "
            "lacks, but the surplus lands in the next batch, a version further behind "
            "(docs/algorithms.md). 0 starts them at the mean of what recent groups gave.",
        ),
    ] = 0.0
    poll_interval_s: Annotated[
        float,
        Field(
            gt=0,
            description="How often to look for a newer policy version; the pool loads one up "
            "to this much after the trainer committed it.",
        ),
    ] = 0.05
    policy_timeout_s: Annotated[
        float,
        Field(gt=0, description="Longest wait for the checkpoint a step needs before failing."),
    ] = 3600.0
    sampling: SamplingConfig = SamplingConfig()
    advantage: AdvantageConfig = GroupRelativeAdvantageConfig()
    truncated_reward: Annotated[
        float | None,
        Field(
            description="Count a rollout that never ended (cut at max_tokens or by seq_len) "
            "with this reward in the advantages; None: its environment's reward. Set it where "
            "a complete answer always fits, so RL keeps the policy ending its replies."
        ),
    ] = None
    filters: Annotated[list[FilterConfig], Field(description="Applied in order.")] = []
    max_steps_without_signal: Annotated[
        int | None,
        Field(
            ge=1,
            description="Fail the run after this many steps in a row whose every group scored "
            "alike (no advantage, no update) at a reward fallen well below the run's best step: "
            "the policy collapsed. Near the best reward (solved, one answer per prompt, never "
            "paid) such steps are only logged. None: never fail.",
        ),
    ] = 20

    @model_validator(mode="after")
    def _env_labels_are_unique(self) -> OrchestratorConfig:
        check_unique_labels(self.envs)
        return self

    @model_validator(mode="after")
    def _rl_samples_at_positive_temperature(self) -> OrchestratorConfig:
        """The one owner of this rule: the trainer weighs each token by its sampling
        probability, which a greedy (temperature 0) sample does not have. Evaluations have
        their own sampling and may be greedy."""
        for where, sampling in (
            ("sampling", self.sampling),
            *((f"envs[{i}].sampling", env.sampling) for i, env in enumerate(self.envs)),
        ):
            if sampling is not None and not sampling.temperature > 0:
                raise ValueError(
                    f"{where}.temperature must be > 0 for RL (got {sampling.temperature}): "
                    "the trainer weighs samples by their sampling probability"
                )
        return self

    @model_validator(mode="after")
    def _off_policy_limit_admits_the_async_bound(self) -> OrchestratorConfig:
        """Below max_async_level the limit would drop rollouts the bound let start: sampled,
        then thrown away, every step."""
        if self.max_async_level and self.max_off_policy_steps < self.max_async_level:
            raise ValueError(
                f"max_off_policy_steps ({self.max_off_policy_steps}) must be at least "
                f"max_async_level ({self.max_async_level}): it would drop the rollouts the "
                "async bound starts"
            )
        return self

    @model_validator(mode="after")
    def _batch_holds_whole_groups(self) -> OrchestratorConfig:
        if self.batch_unit == "samples" and self.batch_size % self.rollouts_per_example:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of rollouts_per_example "
                f"({self.rollouts_per_example}) so every group lands in one batch"
            )
        return self
