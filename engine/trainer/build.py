"""What one trainer rank trains with: the model (loaded, sharded, adapters attached), its
optimizer and schedule, the stage's stores and checkpoint writer, and resuming from the newest
intact checkpoint (`Trainer`). The RL and SFT loops (`engine.trainer.rl`, `engine.trainer.sft`)
and the shared trainer's tenants (`engine.tenancy.shared_trainer`) build on it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig

from engine.config import PrimeflowConfig
from engine.config.model import ModelConfig
from engine.config.trainer import LoraConfig, OptimizerConfig, SchedulerConfig, TrainerConfig
from engine.local_checkpoints import local_checkpoint
from engine.models import resolve_model
from engine.models.tiny import default_cache_dir
from engine.models.tokenizer import load_tokenizer
from engine.run import run_store as open_store
from engine.run import stage_store
from engine.trainer.batching import micro_batches, rank_share, rows_per_micro_batch
from engine.trainer.checkpoint_resume import load_adapter, load_checkpoint
from engine.trainer.checkpoint_writer import CheckpointWriter
from engine.trainer.distributed import DistInfo
from engine.trainer.lora import fresh_adapter, published
from engine.trainer.loss import LossFn
from engine.trainer.metrics import flops_per_token, measure_bf16_peak
from engine.trainer.model import (
    ModelOptions,
    PolicyModel,
    build_policy,
    compute_dtype,
    load_causal_lm,
)
from engine.trainer.optim import build_optimizer
from engine.trainer.packing import PackedRows, Sample, pack_samples
from engine.trainer.schedule import build_scheduler
from engine.trainer.step import StepContext, train_step
from storage.checkpoints import is_adapter, load_checkpoint_weights
from storage.commit import committed_steps, delete_step
from storage.errors import CorruptObjectError
from storage.layout import RunLayout, Stage
from storage.metrics import write_metrics
from storage.store import ObjectStore

FIRST_STEP = 1
log = logging.getLogger("primeflow.trainer")


def model_assets(name: str, model: ModelConfig) -> dict[str, bytes]:
    """Tokenizer and generation config files of the base model `name` (the trainer's copy of
    `model.name`), shipped with every checkpoint: those it has."""
    with tempfile.TemporaryDirectory(prefix="primeflow-assets-") as tmp:
        folder = Path(tmp)
        with contextlib.suppress(OSError, ValueError):
            load_tokenizer(name, model).save_pretrained(str(folder))
        with contextlib.suppress(OSError):
            generation = GenerationConfig.from_pretrained(
                resolve_model(name),
                revision=model.revision or "main",  # transformers' default
            )
            generation.save_pretrained(str(folder))
        return {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()}


@dataclass(frozen=True)
class StagePlan:
    """How a stage trains, beside its model: its optimizer and schedule, its steps and how
    often it commits a resume checkpoint. SFT and RL each state their own (`sft.py`,
    `rl_plan`), so the trainer never asks which stage it runs."""

    optim: OptimizerConfig
    scheduler: SchedulerConfig
    max_steps: int
    checkpoint_interval: int


def rl_plan(config: TrainerConfig) -> StagePlan:
    """RL's plan: the trainer section's optimizer, schedule, steps and checkpoint interval."""
    return StagePlan(config.optim, config.scheduler, config.max_steps, config.checkpoint.interval)


@dataclass
class Trainer:
    """Model, optimizer and schedule of one stage on one rank; `config` is the trainer
    section (sequence length, micro-batches, checkpoints, loss), `plan` the stage's own."""

    config: TrainerConfig
    plan: StagePlan
    stage: Stage
    dist: DistInfo
    store: ObjectStore
    ctx: StepContext
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    run_store: ObjectStore
    assets: dict[str, bytes]
    checkpoints: CheckpointWriter

    @property
    def seq_len(self) -> int:
        return self.config.seq_len

    @property
    def max_steps(self) -> int:
        return self.plan.max_steps

    def pack(self, samples: Sequence[Sample]) -> tuple[list[PackedRows], int]:
        """This rank's micro-batches of `samples` and the step's loss tokens over all ranks."""
        rows = pack_samples(samples, self.seq_len)
        per_micro = rows_per_micro_batch(self.config.micro_batch_tokens, self.seq_len)
        share = rank_share(rows, self.dist.rank, self.dist.world_size, per_micro)
        return micro_batches(share, per_micro), int(rows.loss_mask.sum())

    def step(self, samples: Sequence[Sample], loss_fn: LossFn) -> dict[str, float]:
        batches, loss_tokens = self.pack(samples)
        return train_step(
            self.ctx,
            self.optimizer,
            self.scheduler,
            batches,
            loss_fn,
            loss_tokens,
            self.plan.optim.max_grad_norm,
        )

    def finish_step(self, step: int, metrics: dict[str, Any], progress: dict[str, Any]) -> None:
        """Start the step's resume checkpoint when one is due, then log the step's metrics.

        `checkpoint_seconds` is what the step stalled on it (the snapshot, and waiting for the
        previous checkpoint to be committed); the files are written in the background.
        """
        stalled = 0.0
        if self.should_checkpoint(step):
            stalled = self.checkpoints.save(step, progress)
        metrics["checkpoint_seconds"] = stalled
        self.log_metrics(step, metrics)

    def should_checkpoint(self, step: int) -> bool:
        return step % self.plan.checkpoint_interval == 0 or step == self.max_steps

    def resume(self) -> tuple[int, dict[str, Any]]:
        """(first step to run, data position) from the newest intact committed checkpoint.

        A checkpoint whose files no longer match its marker is passed over, with a warning, for
        the one before it (it is verified in full before anything is loaded), and deleted: its
        steps are trained again, as after any resume from an older checkpoint (RL deletes the
        policy versions past it), and a committed step could not be written over. When every
        checkpoint is damaged the stage fails rather than start again from nothing.
        """
        damaged: CorruptObjectError | None = None
        for step in reversed(committed_steps(self.store, RunLayout.CHECKPOINTS)):
            uri = self.store.url(RunLayout.checkpoint_dir(step))
            try:
                progress = load_checkpoint(
                    self.store, step, self.ctx.policy, self.optimizer, self.scheduler, self.dist
                )
            except CorruptObjectError as exc:
                log.warning("%s: %s is damaged (%s); resuming before it", self.stage, uri, exc)
                damaged = exc
                self._delete_damaged(step)
                continue
            log.info("resumed %s from %s", self.stage, uri)
            return step + 1, progress
        if damaged is not None:
            raise damaged
        return FIRST_STEP, {}

    def _delete_damaged(self, step: int) -> None:
        """Rank 0 deletes damaged checkpoint `step` once every rank has found it so."""
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        if self.dist.is_main:
            delete_step(self.store, RunLayout.checkpoint_dir(step))

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        if self.dist.is_main:
            write_metrics(self.run_store, self.stage, step, metrics)
            shown = {k: round(v, 5) if isinstance(v, float) else v for k, v in metrics.items()}
            log.info("%s step %d %s", self.stage, step, json.dumps(shown, sort_keys=True))


@dataclass(frozen=True)
class StageStart:
    """What a stage builds its model from, beside the config: the checkpoint it starts from
    (None: the model) and the adapters it trains (None: every weight). Each stage states its
    own (`sft_start`; RL: `engine.run.rl_start` and `trainer.lora`) instead of rewriting the
    config it was given."""

    checkpoint: str | None
    lora: LoraConfig | None


def sft_start(config: PrimeflowConfig) -> StageStart:
    """SFT starts from `trainer.init_checkpoint` and trains every weight when
    `sft.full_weights` says so (LoRA RL then trains a fresh adapter on its result)."""
    lora = None if config.sft.full_weights else config.trainer.lora
    return StageStart(config.trainer.init_checkpoint, lora)


def initial_weights(config: TrainerConfig, folder: Path, lora: LoraConfig | None) -> str:
    """The model to load for the start checkpoint `folder`: the folder itself when it holds a
    whole model (for a LoRA run, the base a fresh adapter trains on: a full-weight SFT's
    result), else `trainer.model`, which the folder's LoRA adapter (a LoRA SFT's result) is
    then loaded into."""
    if not is_adapter(folder):
        return str(folder)
    if lora is None:
        raise ValueError(
            f"the start checkpoint {folder} is a LoRA adapter: set trainer.lora to go on "
            "training it"
        )
    return config.model


def adapter_base(config: TrainerConfig, start: str | None, folder: Path | None) -> str:
    """What a LoRA run's adapters are trained on: the start checkpoint when it holds whole
    weights (`folder` is its local copy), else `trainer.model`. Every adapter the run writes
    names it (`base_model_name_or_path`), so that a server can bring that base in before
    serving the adapter."""
    if start is not None and folder is not None and not is_adapter(folder):
        return start
    return config.model


def policy_context(config: PrimeflowConfig, dist: DistInfo, start: StageStart) -> StepContext:
    """Load the model (the weights or adapter of `start.checkpoint` when given), shard it, and
    wrap it with what every step needs."""
    trainer_config = config.trainer
    dtype = compute_dtype(trainer_config.dtype, dist.device)
    options = ModelOptions(
        compute_dtype=dtype,
        activation_checkpointing=trainer_config.activation_checkpointing,
        compile=trainer_config.compile,
        trust_remote_code=config.model.trust_remote_code,
        revision=config.model.revision,
        lora=start.lora,
    )
    folder = start_folder(config, start.checkpoint)
    weights = (
        trainer_config.model
        if folder is None
        else initial_weights(trainer_config, folder, start.lora)
    )
    causal_lm = load_causal_lm(weights, options)
    num_parameters = sum(p.numel() for p in causal_lm.parameters())
    policy = build_policy(causal_lm, dist.mesh, dist.device, options)
    policy.adapter_base = adapter_base(trainer_config, start.checkpoint, folder)
    if policy.lora is not None:
        load_start_adapter(policy, config, start.checkpoint)
    on_gpu = dist.device.type == "cuda"
    return StepContext(
        policy=policy,
        dist=dist,
        compute_dtype=dtype,
        flops_per_token=flops_per_token(policy.config, num_parameters, trainer_config.seq_len),
        peak_flops=measure_bf16_peak(dist.device) if on_gpu else None,
    )


def load_start_adapter(policy: PolicyModel, config: PrimeflowConfig, start: str | None) -> None:
    """A LoRA run's first adapter: checkpoint `start`'s (a LoRA SFT's result), or a fresh one
    drawn from `run.seed` alone, so that a run starts from the same adapter on a trainer of
    its own and as a tenant of shared pools.

    A fresh adapter on a whole-weight `start` trains on that checkpoint, so the model loaded
    must be it: a tenant of shared pools, whose model is the pools', is refused.
    """
    folder = start_folder(config, start)
    whole = folder is not None and not is_adapter(folder)
    if whole and adapter_base(config.trainer, start, folder) != policy.adapter_base:
        raise ValueError(
            f"the start checkpoint {start} holds whole weights, a base of this run's own, but "
            f"the adapter trains on {policy.adapter_base}: start from an adapter (a LoRA SFT's "
            "result) or from no checkpoint"
        )
    if folder is None or whole:
        shapes = {name: tuple(p.shape) for name, p in policy.trainable()}
        load_adapter(policy, published(fresh_adapter(shapes, config.run.seed)))
        return
    load_adapter(policy, load_checkpoint_weights(folder))


def start_folder(config: PrimeflowConfig, start: str | None) -> Path | None:
    """Checkpoint `start` as a local folder (fetched when remote); None for no checkpoint."""
    if start is None:
        return None
    return local_checkpoint(start, default_cache_dir(), config.storage)


def trainer_on(
    ctx: StepContext,
    config: PrimeflowConfig,
    stage: Stage,
    assets: dict[str, bytes],
    plan: StagePlan,
) -> Trainer:
    """A stage's optimizer, schedule, stores and checkpoint writer around the model of `ctx`
    (one model, one trainer; or a shared model and one trainer per tenant)."""
    optimizer = build_optimizer(ctx.policy, plan.optim, ctx.dist.device)
    scheduler = build_scheduler(optimizer, plan.scheduler, plan.max_steps)
    run_store = open_store(config)
    store = stage_store(run_store, stage)
    return Trainer(
        config=config.trainer,
        plan=plan,
        stage=stage,
        dist=ctx.dist,
        store=store,
        run_store=run_store,
        ctx=ctx,
        optimizer=optimizer,
        scheduler=scheduler,
        assets=assets,
        checkpoints=CheckpointWriter(
            store,
            ctx.policy,
            optimizer,
            scheduler,
            ctx.dist,
            files=assets,
            config=config.trainer.checkpoint,
        ),
    )


def build_trainer(
    config: PrimeflowConfig,
    stage: Stage,
    dist: DistInfo,
    assets: dict[str, bytes],
    plan: StagePlan,
    start: StageStart,
) -> Trainer:
    """Load, shard and wrap the model (as `start` says) with the optimizer and schedule of
    `plan`."""
    ctx = policy_context(config, dist, start)
    return trainer_on(ctx, config, stage, assets, plan)
