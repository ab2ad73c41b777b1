"""The trainer's entry, one process per rank under torchrun: `python -m engine.trainer.worker
--config C --stage {sft,rl}`. It joins the process group, pins a CPU trainer's cores, and runs
the stage's loop (`engine.trainer.rl` or `engine.trainer.sft`), which resumes from the newest
committed checkpoint of its stage: weights, optimizer, scheduler, RNG and data position.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from engine.config import PrimeflowConfig
from engine.placement import bind_to_cores
from engine.trainer.build import model_assets
from engine.trainer.distributed import DistInfo, close_distributed, init_distributed
from engine.trainer.rl import run_rl
from engine.trainer.sft import run_sft
from engine.trainer.supervision import watch_supervisor
from engine.watchdog import register_stack_dump
from storage.layout import Stage

#: What one rank runs once it has joined the group: config, the group, the model's files.
RankMain = Callable[[PrimeflowConfig, DistInfo, dict[str, bytes]], None]


def in_process_group(config: PrimeflowConfig, run: RankMain, *, pin: bool = True) -> None:
    """Join the process group and `run` this rank. With `pin`, `trainer.cpu_cores` pins a CPU
    trainer away from the vLLM servers' cores; a GPU trainer is not pinned, so that a CPU
    config runs on a GPU machine with only its devices overridden."""
    if pin and config.trainer.cpu_cores and not torch.cuda.is_available():
        cores = bind_to_cores(config.trainer.cpu_cores, "trainer.cpu_cores")
        if config.trainer.num_threads is None:
            torch.set_num_threads(len(cores))
    dist = init_distributed(config.trainer.parallel.backend)
    try:
        run(config, dist, model_assets(config.trainer.model, config.model))
    finally:
        close_distributed()


def run_stage(config: PrimeflowConfig, stage: Stage) -> None:
    """Run `stage` on this rank. SFT is never pinned: it has no inference beside it."""
    in_process_group(config, run_sft if stage == "sft" else run_rl, pin=stage == "rl")


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
