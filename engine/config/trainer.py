"""The trainer pool: optimizer, schedule, loss, parallelism and checkpoints (docs/training.md)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from engine.config.base import DEFAULT_MAX_STEPS, DEFAULT_SEQ_LEN, BaseConfig
from engine.config.model import TINY_MODEL
from engine.config.plugin import CustomPluginConfig
from engine.placement import parse_cores


class OptimizerConfig(BaseConfig):
    """AdamW (fused on GPU) with gradient clipping."""

    lr: Annotated[float, Field(gt=0, le=1, description="Peak learning rate.")] = 1e-6
    weight_decay: Annotated[float, Field(ge=0, description="Decoupled weight decay.")] = 0.01
    betas: Annotated[
        list[float],
        Field(min_length=2, max_length=2, description="AdamW [beta1, beta2], each in [0, 1)."),
    ] = [0.9, 0.999]
    eps: Annotated[float, Field(gt=0, description="AdamW epsilon.")] = 1e-8
    max_grad_norm: Annotated[
        float | None, Field(gt=0, description="Clip the global gradient norm; None: no clipping.")
    ] = 1.0

    @model_validator(mode="after")
    def _betas_in_range(self) -> OptimizerConfig:
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must each be in [0, 1), got {self.betas}")
        return self


class _WarmupConfig(BaseConfig):
    warmup_steps: Annotated[
        int, Field(ge=0, description="Linear warmup from 0 to the peak lr.")
    ] = 0


class ConstantSchedulerConfig(_WarmupConfig):
    """Constant learning rate after warmup."""

    type: Literal["constant"] = "constant"


class LinearSchedulerConfig(_WarmupConfig):
    """Linear decay from the peak to `min_lr_ratio`·peak at the last step."""

    type: Literal["linear"] = "linear"
    min_lr_ratio: Annotated[
        float, Field(ge=0, le=1, description="Final lr as a share of peak.")
    ] = 0.0


class CosineSchedulerConfig(_WarmupConfig):
    """Cosine decay from the peak to `min_lr_ratio`·peak at the last step."""

    type: Literal["cosine"] = "cosine"
    min_lr_ratio: Annotated[
        float, Field(ge=0, le=1, description="Final lr as a share of peak.")
    ] = 0.0


SchedulerConfig = Annotated[
    ConstantSchedulerConfig | LinearSchedulerConfig | CosineSchedulerConfig,
    Field(discriminator="type"),
]


class BuiltinLossConfig(BaseConfig):
    """What every built-in RL loss shares: how tokens are weighed, and an entropy bonus."""

    normalization: Annotated[
        Literal["token", "sequence"],
        Field(
            description="token: every loss token of the step weighs the same (long answers "
            "weigh more); sequence: every sample weighs the same, its tokens averaged first."
        ),
    ] = "token"
    entropy_coef: Annotated[
        float,
        Field(
            ge=0,
            description="Subtract this × the policy's entropy per token from the loss, "
            "which keeps sampling exploring; 0: off.",
        ),
    ] = 0.0


class AipoLossConfig(BuiltinLossConfig):
    """AIPO: token-level ratio π_train/π_inference, capped, times the advantage; no KL."""

    type: Literal["aipo"] = "aipo"
    ratio_cap: Annotated[
        float, Field(gt=1, description="Cap on the importance ratio π_train/π_inference.")
    ] = 8.0


class MaskedRatioLossConfig(BuiltinLossConfig):
    """Tokens whose importance ratio leaves [low, high] are masked; small log-ratio² KL term."""

    type: Literal["masked_ratio"] = "masked_ratio"
    ratio_low: Annotated[float, Field(gt=0, le=1, description="Mask tokens below this ratio.")] = (
        0.5
    )
    ratio_high: Annotated[float, Field(ge=1, description="Mask tokens above this ratio.")] = 2.0
    kl_coef: Annotated[
        float, Field(ge=0, description="Weight of the log-ratio² term against inference.")
    ] = 1e-3


class PpoClipLossConfig(BuiltinLossConfig):
    """GRPO/PPO's clipped surrogate: min(r·A, clip(r, 1-low, 1+high)·A), r against inference."""

    type: Literal["ppo_clip"] = "ppo_clip"
    clip_low: Annotated[
        float, Field(gt=0, lt=1, description="Lower clip: the ratio may fall to 1 - this.")
    ] = 0.2
    clip_high: Annotated[
        float,
        Field(gt=0, description="Upper clip: the ratio may rise to 1 + this (DAPO: 0.28)."),
    ] = 0.28


class PolicyGradientLossConfig(BuiltinLossConfig):
    """Plain policy gradient, −A·log π_train, no importance weight: exactly on-policy GRPO with
    one step per batch (TRL's update), biased by any staleness or trainer–inference mismatch."""

    type: Literal["pg"] = "pg"


LossConfig = Annotated[
    AipoLossConfig
    | MaskedRatioLossConfig
    | PpoClipLossConfig
    | PolicyGradientLossConfig
    | CustomPluginConfig,
    Field(discriminator="type"),
]


class CheckpointConfig(BaseConfig):
    """When resume checkpoints (weights, optimizer, scheduler, RNG) are committed, how many kept.

    Inference never waits for these: RL publishes a policy version every step (`PolicyConfig`).
    """

    interval: Annotated[
        int, Field(ge=1, description="Commit a checkpoint every N steps (and always at the end).")
    ] = 10
    keep_last: Annotated[
        int | None, Field(ge=1, description="Keep the newest N checkpoints; None keeps all.")
    ] = 3
    keep_every: Annotated[
        int | None,
        Field(ge=1, description="Also keep every checkpoint whose step is a multiple of N."),
    ] = None
    max_shard_gb: Annotated[
        float, Field(gt=0, description="Split model weights into safetensors files of this size.")
    ] = 5.0


class PolicyConfig(BaseConfig):
    """Policy versions: the weights alone, in the serving dtype, published every RL step."""

    keep_last: Annotated[
        int | None,
        Field(ge=1, description="Keep the newest N policy versions; None keeps all."),
    ] = 3
    keep_every: Annotated[
        int | None,
        Field(ge=1, description="Also keep every policy version whose step is a multiple of N."),
    ] = None
    full_every: Annotated[
        int,
        Field(
            ge=1,
            description="A full version every N versions; the others are exact deltas against "
            "the version before (a reader needs one full version plus at most N-1 deltas). "
            "1 writes every version full.",
        ),
    ] = 10


#: The projections of a Llama/Qwen-style block: attention's four and the MLP's three.
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(BaseConfig):
    """Low-rank adapters (PEFT's LoRA) on the base model's linear layers: only they train, and
    a policy version is the adapter alone (see docs/training.md, "LoRA")."""

    rank: Annotated[int, Field(ge=1, le=512, description="r, the adapters' rank.")] = 8
    alpha: Annotated[float, Field(gt=0, description="Scale: the update is alpha/rank × B·A.")] = (
        16.0
    )
    dropout: Annotated[
        float,
        Field(
            ge=0,
            lt=1,
            description="Dropout on the adapters' input; 0 keeps the trained policy the one that "
            "sampled (RL's importance ratios assume so).",
        ),
    ] = 0.0
    target_modules: Annotated[
        list[str],
        Field(min_length=1, description="Names of the linear layers that get an adapter."),
    ] = LORA_TARGETS

    @model_validator(mode="after")
    def _head_and_embeddings_stay_base(self) -> LoraConfig:
        # The LM head is read as a plain weight by the fused log-prob kernel, and vLLM's
        # runtime LoRA serves adapters on the blocks' projections only.
        refused = sorted({"lm_head", "embed_tokens"} & set(self.target_modules))
        if refused:
            raise ValueError(f"target_modules: {refused} cannot take a LoRA adapter")
        return self


class ParallelConfig(BaseConfig):
    """The torchrun process group: FSDP2 across `nproc_per_node` × `nnodes` ranks."""

    nproc_per_node: Annotated[int, Field(ge=1, description="Trainer processes on this node.")] = 1
    nnodes: Annotated[int, Field(ge=1, description="Nodes in the trainer group.")] = 1
    backend: Annotated[
        Literal["auto", "gloo", "nccl"],
        Field(description="auto: NCCL when CUDA is available, gloo otherwise."),
    ] = "auto"
    gpu_ids: Annotated[
        list[int], Field(description="CUDA devices for the trainer; empty: the first N.")
    ] = []
    rdzv_endpoint: Annotated[
        str | None,
        Field(description="host:port of torchrun's c10d rendezvous; needed when nnodes > 1."),
    ] = None

    @model_validator(mode="after")
    def _multi_node_needs_rendezvous(self) -> ParallelConfig:
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("nnodes > 1 needs rdzv_endpoint (host:port reachable from every node)")
        return self


class TrainerConfig(BaseConfig):
    """The FSDP2 trainer pool, shared by the SFT and RL stages."""

    model: Annotated[
        str, Field(description="Model to train; filled from the shared `model.name`.")
    ] = TINY_MODEL
    seq_len: Annotated[
        int, Field(ge=16, description="Packed row length in tokens; filled from `seq_len`.")
    ] = DEFAULT_SEQ_LEN
    init_checkpoint: Annotated[
        str | None,
        Field(
            description="Committed checkpoint (path or URI) whose weights SFT starts from "
            "instead of the model's; RL too, unless the run has an SFT result of its own."
        ),
    ] = None
    max_steps: Annotated[
        int, Field(ge=1, description="RL optimizer steps; filled from `max_steps`.")
    ] = DEFAULT_MAX_STEPS
    micro_batch_tokens: Annotated[
        int | None,
        Field(ge=16, description="Tokens per micro-batch (gradient accumulation); None: seq_len."),
    ] = None
    dtype: Annotated[
        Literal["auto", "bfloat16", "float32"],
        Field(description="Parameter dtype: auto is bf16 on GPU, fp32 on CPU."),
    ] = "auto"
    activation_checkpointing: Annotated[
        bool, Field(description="Recompute block activations in backward to save memory.")
    ] = False
    compile: Annotated[bool, Field(description="torch.compile each transformer block.")] = False
    num_threads: Annotated[
        int | None,
        Field(
            ge=1,
            description=(
                "CPU threads per rank (OMP_NUM_THREADS); None: torch's default. On a small CPU "
                "machine that also runs vLLM, 1 avoids OpenMP threads spinning against it."
            ),
        ),
    ] = None
    cpu_cores: Annotated[
        str | None,
        Field(
            description=(
                "CPU only: the cores the trainer's ranks run on during RL, e.g. '0' or '0-3' "
                "(taskset syntax), apart from the inference pool's `inference.cpu_cores`, so "
                "that their threads do not spin against each other; torch then uses one thread "
                "per core unless num_threads says otherwise. SFT, which runs while the pool "
                "idles, uses every core. None: no binding."
            )
        ),
    ] = None
    truncate: Annotated[
        bool,
        Field(description="Cut samples longer than seq_len to seq_len instead of failing."),
    ] = False
    optim: OptimizerConfig = OptimizerConfig()
    scheduler: SchedulerConfig = ConstantSchedulerConfig()
    loss: LossConfig = AipoLossConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    policy: PolicyConfig = PolicyConfig()
    parallel: ParallelConfig = ParallelConfig()
    lora: Annotated[
        LoraConfig | None,
        Field(description="Train LoRA adapters instead of every weight; None: full weights."),
    ] = None
    rollout_timeout_s: Annotated[
        float, Field(gt=0, description="How long to wait for the rollouts of a step.")
    ] = 3600.0
    poll_interval_s: Annotated[
        float,
        Field(
            gt=0,
            description="How often to look for the next step's rollouts; the trainer starts "
            "a step up to this much after the orchestrator committed it.",
        ),
    ] = 0.05

    @field_validator("cpu_cores")
    @classmethod
    def _core_list(cls, value: str | None) -> str | None:
        if value is not None:
            parse_cores(value)
        return value
