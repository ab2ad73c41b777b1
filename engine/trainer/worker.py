"""The trainer loop, one process per rank under torchrun: `python -m engine.trainer.worker`.

RL: for each step n (1-based; the base model is policy version 0) wait for the committed
`rollouts/step_n`, pack and train on them, publish `policies/step_n` — the weights of policy
version n, in the background (`engine.trainer.publish`) — and commit the resume checkpoint
`checkpoints/step_n` every `checkpoint.interval` steps and at the last step. SFT does the same on
its own data under `<run>/sft/`, so its steps never collide with RL's.

Every rank reads the whole step and computes the same packing and rank assignment, so the
ranks agree on the step's loss-token count without a collective. On start the loop resumes from
the newest committed checkpoint of its stage: weights, optimizer, scheduler, RNG and data
position.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from engine.config import PrimeflowConfig
from engine.config.trainer import OptimizerConfig, SchedulerConfig, TrainerConfig
from engine.local_checkpoints import local_checkpoint
from engine.models import resolve_model
from engine.models.tiny import default_cache_dir
from engine.placement import bind_to_cores
from engine.run import run_store as open_store
from engine.run import stage_store
from engine.trainer.batching import micro_batches, rank_share, rows_per_micro_batch
from engine.trainer.checkpoint import CheckpointWriter, load_adapter, load_checkpoint
from engine.trainer.distributed import (
    DistInfo,
    agree_sums,
    close_distributed,
    init_distributed,
)
from engine.trainer.lora import fresh_adapter, published
from engine.trainer.loss import (
    LossFn,
    build_loss,
    loss_normalization,
    sequence_weights,
    sft_loss,
)
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
from engine.trainer.publish import AdapterPublisher, PolicyPublisher
from engine.trainer.rollouts import no_rollouts_error, samples_from_rollouts
from engine.trainer.schedule import build_scheduler
from engine.trainer.sft_data import SftDataset, iter_batches, load_sft_dataset
from engine.trainer.step import StepContext, eval_step, train_step
from engine.trainer.supervision import watch_supervisor
from engine.watchdog import register_stack_dump
from storage.checkpoints import is_adapter, load_checkpoint_weights
from storage.commit import committed_steps, delete_step, is_committed
from storage.errors import CorruptObjectError
from storage.layout import RunLayout, Stage
from storage.metrics import write_metrics
from storage.shards import read_rollouts
from storage.store import ObjectStore

FIRST_STEP = 1
#: How often a trainer waiting for rollouts looks whether a reader discarded its newest
#: policy version (one marker read on rank 0).
REPAIR_CHECK_S = 1.0
log = logging.getLogger("primeflow.trainer")


def _load_tokenizer(name: str, revision: str | None) -> PreTrainedTokenizerBase | None:
    try:
        return AutoTokenizer.from_pretrained(resolve_model(name), revision=revision)
    except (OSError, ValueError):
        return None


def model_assets(name: str, revision: str | None) -> dict[str, bytes]:
    """Tokenizer and generation config files of the base model, shipped with every checkpoint."""
    with tempfile.TemporaryDirectory(prefix="primeflow-assets-") as tmp:
        folder = Path(tmp)
        tokenizer = _load_tokenizer(name, revision)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(folder))
        with contextlib.suppress(OSError):
            generation = GenerationConfig.from_pretrained(
                resolve_model(name),
                revision=revision or "main",  # transformers' default
            )
            generation.save_pretrained(str(folder))
        return {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()}


@dataclass
class Trainer:
    """Model, optimizer and schedule of one stage on one rank."""

    config: PrimeflowConfig
    stage: Stage
    dist: DistInfo
    store: ObjectStore
    ctx: StepContext
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    run_store: ObjectStore
    assets: dict[str, bytes]
    max_steps: int
    checkpoints: CheckpointWriter

    @property
    def seq_len(self) -> int:
        assert self.config.trainer.seq_len is not None
        return self.config.trainer.seq_len

    def pack(self, samples: Sequence[Sample]) -> tuple[list[PackedRows], int]:
        """This rank's micro-batches of `samples` and the step's loss tokens over all ranks."""
        rows = pack_samples(samples, self.seq_len)
        per_micro = rows_per_micro_batch(self.config.trainer.micro_batch_tokens, self.seq_len)
        share = rank_share(rows, self.dist.rank, self.dist.world_size, per_micro)
        return micro_batches(share, per_micro), int(rows.loss_mask.sum())

    def step(
        self, samples: Sequence[Sample], loss_fn: LossFn, optim: OptimizerConfig
    ) -> dict[str, float]:
        batches, loss_tokens = self.pack(samples)
        return train_step(
            self.ctx,
            self.optimizer,
            self.scheduler,
            batches,
            loss_fn,
            loss_tokens,
            optim.max_grad_norm,
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
        if self.stage == "sft":
            interval = self.config.sft.checkpoint_interval
        else:
            interval = self.config.trainer.checkpoint.interval
        return step % interval == 0 or step == self.max_steps

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


def initial_weights(config: TrainerConfig, folder: Path) -> str:
    """The model to load for `init_checkpoint` `folder`: the folder itself when it holds a
    whole model (for a LoRA run, the base a fresh adapter trains on: a full-weight SFT's
    result), else `trainer.model`, which the folder's LoRA adapter (a LoRA SFT's result) is
    then loaded into."""
    if not is_adapter(folder):
        return str(folder)
    if config.lora is None:
        raise ValueError(
            f"trainer.init_checkpoint {folder} is a LoRA adapter: set trainer.lora to go on "
            "training it"
        )
    assert config.model is not None
    return config.model


def adapter_base(config: TrainerConfig, folder: Path | None) -> str:
    """What a LoRA run's adapters are trained on, as configured: `trainer.init_checkpoint`
    when it holds whole weights (`folder` is its local copy), else `trainer.model`. Every
    adapter the run writes names it (`base_model_name_or_path`), so that a server can bring
    that base in before serving the adapter."""
    if folder is not None and not is_adapter(folder):
        assert config.init_checkpoint is not None
        return config.init_checkpoint
    assert config.model is not None
    return config.model


def policy_context(config: PrimeflowConfig, dist: DistInfo) -> StepContext:
    """Load the model (`trainer.init_checkpoint`'s weights or adapter when set), shard it,
    and wrap it with what every step needs."""
    trainer_config = config.trainer
    assert trainer_config.model is not None and trainer_config.seq_len is not None
    dtype = compute_dtype(trainer_config.dtype, dist.device)
    options = ModelOptions(
        compute_dtype=dtype,
        activation_checkpointing=trainer_config.activation_checkpointing,
        compile=trainer_config.compile,
        trust_remote_code=config.model.trust_remote_code,
        revision=config.model.revision,
        lora=trainer_config.lora,
    )
    folder = init_folder(config)
    weights = trainer_config.model if folder is None else initial_weights(trainer_config, folder)
    causal_lm = load_causal_lm(weights, options)
    num_parameters = sum(p.numel() for p in causal_lm.parameters())
    policy = build_policy(causal_lm, dist.mesh, dist.device, options)
    policy.adapter_base = adapter_base(trainer_config, folder)
    if policy.lora is not None:
        load_start_adapter(policy, config)
    on_gpu = dist.device.type == "cuda"
    return StepContext(
        policy=policy,
        dist=dist,
        compute_dtype=dtype,
        flops_per_token=flops_per_token(policy.config, num_parameters, trainer_config.seq_len),
        peak_flops=measure_bf16_peak(dist.device) if on_gpu else None,
    )


def load_start_adapter(policy: PolicyModel, config: PrimeflowConfig) -> None:
    """A LoRA run's first adapter: `trainer.init_checkpoint`'s (a LoRA SFT's result), or a
    fresh one drawn from `run.seed` alone, so that a run starts from the same adapter on a
    trainer of its own and as a tenant of shared pools.

    A fresh adapter on a whole-weight `init_checkpoint` trains on that checkpoint, so the
    model loaded must be it: a tenant of shared pools, whose model is the pools', is refused.
    """
    folder = init_folder(config)
    whole = folder is not None and not is_adapter(folder)
    if whole and adapter_base(config.trainer, folder) != policy.adapter_base:
        raise ValueError(
            f"trainer.init_checkpoint {config.trainer.init_checkpoint} holds whole weights, a "
            f"base of this run's own, but the adapter trains on {policy.adapter_base}: start "
            "from an adapter (a LoRA SFT's result) or from no checkpoint"
        )
    if folder is None or whole:
        shapes = {name: tuple(p.shape) for name, p in policy.trainable()}
        load_adapter(policy, published(fresh_adapter(shapes, config.run.seed)))
        return
    load_adapter(policy, load_checkpoint_weights(folder))


def init_folder(config: PrimeflowConfig) -> Path | None:
    """`trainer.init_checkpoint` as a local folder (fetched when remote); None when unset."""
    if config.trainer.init_checkpoint is None:
        return None
    return local_checkpoint(config.trainer.init_checkpoint, default_cache_dir(), config.storage)


def trainer_on(
    ctx: StepContext,
    config: PrimeflowConfig,
    stage: Stage,
    assets: dict[str, bytes],
    optim: OptimizerConfig,
    scheduler_config: SchedulerConfig,
    max_steps: int,
) -> Trainer:
    """A stage's optimizer, schedule, stores and checkpoint writer around the model of `ctx`
    (one model, one trainer; or a shared model and one trainer per tenant)."""
    optimizer = build_optimizer(ctx.policy, optim, ctx.dist.device)
    scheduler = build_scheduler(optimizer, scheduler_config, max_steps)
    run_store = open_store(config)
    store = stage_store(run_store, stage)
    return Trainer(
        config=config,
        stage=stage,
        dist=ctx.dist,
        store=store,
        run_store=run_store,
        ctx=ctx,
        optimizer=optimizer,
        scheduler=scheduler,
        assets=assets,
        max_steps=max_steps,
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
    optim: OptimizerConfig,
    scheduler_config: SchedulerConfig,
    max_steps: int,
) -> Trainer:
    """Load, shard and wrap the model with its optimizer and schedule."""
    ctx = policy_context(config, dist)
    return trainer_on(ctx, config, stage, assets, optim, scheduler_config, max_steps)


def run_rl(config: PrimeflowConfig, dist: DistInfo, assets: dict[str, bytes]) -> None:
    """RL: one optimizer step per committed rollout step, up to `trainer.max_steps`."""
    trainer_config = config.trainer
    assert trainer_config.max_steps is not None
    trainer = build_trainer(
        config,
        "rl",
        dist,
        assets,
        trainer_config.optim,
        trainer_config.scheduler,
        trainer_config.max_steps,
    )
    loss_fn = build_loss(trainer_config.loss)
    first, _ = trainer.resume()
    publisher = start_publishing(trainer, first - 1)
    try:
        train_rl_steps(trainer, publisher, first, loss_fn)
        publisher.flush()
        trainer.checkpoints.flush()
    finally:
        publisher.close()
        trainer.checkpoints.close()


def train_rl_steps(
    trainer: Trainer, publisher: PolicyPublisher, first: int, loss_fn: LossFn
) -> None:
    """Steps `first` .. max_steps: wait for the rollouts, train, publish, checkpoint when due."""
    for step in range(first, trainer.max_steps + 1):
        wait_start = time.perf_counter()
        table = await_rollouts(trainer, publisher, step)
        train_rl_step(trainer, publisher, loss_fn, step, table, time.perf_counter() - wait_start)


def await_rollouts(trainer: Trainer, publisher: PolicyPublisher, step: int) -> pa.Table:
    """Step `step`'s committed rollouts, read and verified once every rank sees them.

    Meanwhile the newest policy version is published again if a reader discarded it
    (`PolicyPublisher.repair`, every `REPAIR_CHECK_S`): the orchestrator may be waiting for
    exactly that version. The ranks poll in lockstep (one small all-reduce a poll), so they
    agree on when to repair, which is collective, and on when to go on.
    """
    config = trainer.config.trainer
    deadline = time.monotonic() + config.rollout_timeout_s
    repair_every = max(1, round(REPAIR_CHECK_S / config.poll_interval_s))
    polls = 0
    while True:
        seen = is_committed(trainer.store, RunLayout.rollouts_dir(step))
        if agree_sums([int(seen)], trainer.dist)[0] == trainer.dist.world_size:
            return read_rollouts(trainer.store, step)
        polls += 1
        if polls % repair_every == 0:
            publisher.repair()
        if time.monotonic() > deadline:
            raise no_rollouts_error(trainer.store, step, config.rollout_timeout_s)
        time.sleep(config.poll_interval_s)


def train_rl_step(
    trainer: Trainer,
    publisher: PolicyPublisher,
    loss_fn: LossFn,
    step: int,
    table: pa.Table,
    wait_seconds: float,
) -> None:
    """Train on step `step`'s committed rollouts `table`, publish the policy, checkpoint when
    due, log the step's metrics."""
    trainer_config = trainer.config.trainer
    samples = samples_from_rollouts(
        table,
        step=step,
        vocab_size=trainer.ctx.policy.config.vocab_size,
        seq_len=trainer.seq_len,
        allow_truncation=trainer_config.truncate,
    )
    if loss_normalization(trainer_config.loss) == "sequence":
        weights = sequence_weights([int(s.loss_mask[1:].sum()) for s in samples])
        samples = [replace(s, weight=w) for s, w in zip(samples, weights, strict=True)]
    metrics = trainer.step(samples, loss_fn, trainer_config.optim)
    metrics.update(publisher.publish(step))
    versions = table.column("policy_version").to_pylist()
    metrics.update(
        samples=len(samples),
        wait_seconds=wait_seconds,
        policy_lag_max=max((step - 1 - v for v in versions), default=0),
    )
    trainer.finish_step(step, metrics, {"rollout_step": step})


def start_publishing(trainer: Trainer, resumed_at: int) -> PolicyPublisher:
    """The run's publisher, its lineage starting at the policy the trainer resumed from
    (`PolicyPublisher.start`: versions past it deleted, it published unless committed)."""
    publishing = PolicyPublisher if trainer.ctx.policy.lora is None else AdapterPublisher
    publisher = publishing(
        trainer.store,
        trainer.ctx.policy,
        trainer.optimizer,
        trainer.dist,
        config=trainer.config.trainer.policy,
        files=trainer.assets,
        lineage=resumed_at,
    )
    forgotten = publisher.start(resumed_at)
    if forgotten:
        log.info("deleted policy versions %s of the previous lineage", forgotten)
    log.info("policy lineage %s starts at version %d", publisher.lineage_id, resumed_at)
    return publisher


def sft_max_steps(config: PrimeflowConfig, data: SftDataset) -> int:
    """`sft.max_steps`, or fewer when `sft.epochs` runs out first."""
    sft = config.sft
    if sft.epochs is None:
        return sft.max_steps
    return max(1, min(sft.max_steps, math.ceil(sft.epochs * len(data.train) / sft.batch_size)))


def run_sft(config: PrimeflowConfig, dist: DistInfo, assets: dict[str, bytes]) -> None:
    """SFT: NLL on assistant tokens, seeded epochs, eval loss on the held-out split."""
    sft = config.sft
    assert config.trainer.model is not None and config.trainer.seq_len is not None
    tokenizer = _load_tokenizer(config.trainer.model, config.model.revision)
    if tokenizer is None:
        raise ValueError(f"SFT needs a tokenizer with a chat template: {config.trainer.model!r}")
    data = load_sft_dataset(
        sft.data,
        tokenizer,
        seq_len=config.trainer.seq_len,
        seed=config.run.seed,
        allow_truncation=config.trainer.truncate,
    )
    max_steps = sft_max_steps(config, data)
    trainer = build_trainer(config, "sft", dist, assets, sft.optim, sft.scheduler, max_steps)
    first, progress = trainer.resume()
    position = int(progress.get("position", 0))
    try:
        for step in range(first, max_steps + 1):
            metrics = trainer.step(data.batch(position, sft.batch_size), sft_loss, sft.optim)
            position += sft.batch_size
            metrics["epoch"] = position / len(data.train)
            if data.eval and (step % sft.eval_interval == 0 or step == max_steps):
                metrics["eval_loss"] = evaluate(trainer, data.eval, sft.batch_size)["loss"]
            trainer.finish_step(step, metrics, {"position": position})
        trainer.checkpoints.flush()
    finally:
        trainer.checkpoints.close()


def evaluate(trainer: Trainer, samples: Sequence[Sample], batch_size: int) -> dict[str, float]:
    """Mean NLL per assistant token over `samples`."""
    sums = {"loss": 0.0}
    tokens = 0
    for batch in iter_batches(samples, batch_size):
        micro, loss_tokens = trainer.pack(batch)
        result = eval_step(trainer.ctx, micro, sft_loss, loss_tokens)
        sums["loss"] += result["loss"] * loss_tokens
        tokens += loss_tokens
    return {"loss": sums["loss"] / max(tokens, 1)}


#: What one rank runs once it has joined the group: config, the group, the model's files.
RankMain = Callable[[PrimeflowConfig, DistInfo, dict[str, bytes]], None]


def in_process_group(config: PrimeflowConfig, run: RankMain) -> None:
    """Join the process group and `run` this rank. `trainer.cpu_cores` pins a CPU trainer away
    from the vLLM servers' cores; a GPU trainer is not pinned, so that a CPU config runs on a GPU
    machine with only its devices overridden."""
    assert config.trainer.model is not None
    if config.trainer.cpu_cores and not torch.cuda.is_available():
        cores = bind_to_cores(config.trainer.cpu_cores, "trainer.cpu_cores")
        if config.trainer.num_threads is None:
            torch.set_num_threads(len(cores))
    dist = init_distributed(config.trainer.parallel.backend)
    try:
        run(config, dist, model_assets(config.trainer.model, config.model.revision))
    finally:
        close_distributed()


def run_stage(config: PrimeflowConfig, stage: Stage) -> None:
    """Run `stage` on this rank. SFT is never pinned (it has no inference beside it), and
    trains every weight when `sft.full_weights` says so."""
    if stage == "sft":
        lora = None if config.sft.full_weights else config.trainer.lora
        config = config.model_copy(
            update={"trainer": config.trainer.model_copy(update={"cpu_cores": None, "lora": lora})}
        )
    in_process_group(config, run_sft if stage == "sft" else run_rl)


def rank_config(config_path: str) -> PrimeflowConfig:
    """A rank's start: logging to stderr (torchrun's log), the config, the supervisor watch
    and the stack-dump hook."""
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    config = PrimeflowConfig.model_validate_json(Path(config_path).read_text())
    watch_supervisor()
    register_stack_dump()
    return config


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.trainer.worker")
    parser.add_argument("--config", required=True, help="resolved PrimeflowConfig as JSON")
    parser.add_argument("--stage", choices=["sft", "rl"], required=True)
    args = parser.parse_args(argv)
    run_stage(rank_config(args.config), args.stage)
    return 0


if __name__ == "__main__":
    sys.exit(main())
