"""The SFT loop of one rank: NLL on assistant tokens of the SFT data, seeded epochs, eval loss
on the held-out split. Its steps live under `<run>/sft/`, so they never collide with RL's; a
resume picks up the data position with the weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from engine.config import PrimeflowConfig
from engine.models.tokenizer import load_tokenizer
from engine.trainer.build import StagePlan, Trainer, build_trainer, sft_start
from engine.trainer.distributed import DistInfo
from engine.trainer.loss import sft_loss
from engine.trainer.packing import Sample
from engine.trainer.sft_data import SftDataset, iter_batches, load_sft_dataset
from engine.trainer.step import eval_step


def sft_max_steps(config: PrimeflowConfig, data: SftDataset) -> int:
    """`sft.max_steps`, or fewer when `sft.epochs` runs out first."""
    sft = config.sft
    if sft.epochs is None:
        return sft.max_steps
    return max(1, min(sft.max_steps, math.ceil(sft.epochs * len(data.train) / sft.batch_size)))


def run_sft(config: PrimeflowConfig, dist: DistInfo, assets: dict[str, bytes]) -> None:
    """SFT: NLL on assistant tokens, seeded epochs, eval loss on the held-out split."""
    sft = config.sft
    tokenizer = load_tokenizer(config.trainer.model, config.model)
    data = load_sft_dataset(
        sft.data,
        tokenizer,
        seq_len=config.trainer.seq_len,
        seed=config.run.seed,
        allow_truncation=config.trainer.truncate,
    )
    max_steps = sft_max_steps(config, data)
    start = sft_start(config)
    plan = StagePlan(sft.optim, sft.scheduler, max_steps, sft.checkpoint_interval)
    trainer = build_trainer(config, "sft", dist, assets, plan, start)
    first, progress = trainer.resume()
    position = int(progress.get("position", 0))
    try:
        for step in range(first, max_steps + 1):
            metrics = trainer.step(data.batch(position, sft.batch_size), sft_loss)
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
