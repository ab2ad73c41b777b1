"""The SFT stage end to end: it learns, reports eval loss, checkpoints under `<run>/sft`."""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.config import PrimeflowConfig
from engine.config.trainer import LoraConfig
from engine.run import run_store as open_run_store
from engine.run import stage_store
from engine.trainer.build import load_start_adapter
from engine.trainer.checkpoint_resume import latest_checkpoint
from engine.trainer.worker import run_stage
from storage.checkpoints import fetch_checkpoint, load_checkpoint_weights
from storage.commit import committed_steps, read_commit, verify_step
from storage.layout import RunLayout
from storage.metrics import read_metrics
from tests.integration.trainer.conftest import make_config, write_steps


def local_run_root(tmp_path: Path) -> Path:
    return tmp_path / "runs" / "sft"


def write_data(path: Path, n: int) -> None:
    rng = np.random.default_rng(0)
    with path.open("w") as handle:
        for value in rng.integers(1000, 9999, n):
            row = {"prompt": str(value), "completion": str(value)[::-1]}
            handle.write(json.dumps(row) + "\n")


def sft_config(tmp_path: Path, model: Path, max_steps: int) -> PrimeflowConfig:
    return PrimeflowConfig.model_validate(
        {
            "run": {"name": "sft"},
            "model": {"name": str(model)},
            "storage": {"uri": f"file://{tmp_path}/runs"},
            "seq_len": 128,
            "trainer": {"micro_batch_tokens": 256, "checkpoint": {"keep_last": 2}},
            "sft": {
                "data": {"path": str(tmp_path / "data.jsonl"), "eval_fraction": 0.1},
                "batch_size": 16,
                "max_steps": max_steps,
                "eval_interval": 5,
                "checkpoint_interval": 5,
                "optim": {"lr": 3e-3, "weight_decay": 0.0},
            },
        }
    )


def test_sft_learns_evaluates_and_resumes(tmp_path: Path, tiny_model_dir: Path) -> None:
    write_data(tmp_path / "data.jsonl", 200)

    def config(max_steps: int) -> PrimeflowConfig:
        return sft_config(tmp_path, tiny_model_dir, max_steps)

    run_stage(config(10), "sft")
    run_stage(config(20), "sft")  # resumes at step 11 with the data position of step 10
    run = open_run_store(config(20))
    lines = read_metrics(run, "sft")
    assert [line["step"] for line in lines] == list(range(1, 21))
    assert lines[10]["epoch"] == 11 * 16 / 180
    evals = [line["eval_loss"] for line in lines if "eval_loss" in line]
    assert len(evals) == 4  # steps 5, 10 (the first run's last), 15, 20
    assert evals[-1] < 0.75 * evals[0], evals
    assert np.mean([x["loss"] for x in lines[-5:]]) < np.mean([x["loss"] for x in lines[:5]])
    sft = stage_store(run, "sft")
    assert latest_checkpoint(sft) == 20
    assert sft.list("checkpoints") == ["step_000015", "step_000020"]  # keep_last = 2
    assert not run.exists("checkpoints")  # RL's checkpoints are a separate series


def test_a_damaged_newest_checkpoint_resumes_from_the_one_before(
    tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_data(tmp_path / "data.jsonl", 200)
    run_stage(sft_config(tmp_path, tiny_model_dir, 10), "sft")
    sft = stage_store(open_run_store(sft_config(tmp_path, tiny_model_dir, 10)), "sft")
    weights = local_run_root(tmp_path) / "sft" / RunLayout.checkpoint_dir(10) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4096:] = bytes(b ^ 0xFF for b in data[-4096:])
    weights.write_bytes(bytes(data))

    with caplog.at_level(logging.WARNING, logger="primeflow.trainer"):
        run_stage(sft_config(tmp_path, tiny_model_dir, 12), "sft")
    assert "step_000010 is damaged" in caplog.text and "model.safetensors" in caplog.text
    # Steps 6-12 were trained again from checkpoint 5; the damaged one was replaced.
    assert latest_checkpoint(sft) == 12
    assert sft.list("checkpoints") == ["step_000010", "step_000012"]
    verify_step(sft, RunLayout.checkpoint_dir(10))


def test_lora_sft_learns_and_rl_goes_on_from_its_adapter(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A LoRA SFT commits adapters only, learns, and an RL stage started from its result
    trains that very adapter on (its version 0 is the SFT adapter, bit for bit)."""
    write_data(tmp_path / "data.jsonl", 200)
    lora = {"rank": 8, "alpha": 16.0}
    config = sft_config(tmp_path, tiny_model_dir, 20)
    config = config.model_copy(
        update={"trainer": config.trainer.model_copy(update={"lora": LoraConfig(**lora)})}
    )
    run_stage(config, "sft")
    run = open_run_store(config)
    evals = [line["eval_loss"] for line in read_metrics(run, "sft") if "eval_loss" in line]
    assert evals[-1] < 0.9 * evals[0], evals
    sft = stage_store(run, "sft")
    final = read_commit(sft, RunLayout.checkpoint_dir(20))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(final.files)
    assert not any(name.startswith("model") for name in final.files)

    rl = make_config(
        tmp_path, tiny_model_dir, "sft", max_steps=2,
        trainer={"lora": lora, "init_checkpoint": sft.url(RunLayout.checkpoint_dir(20))},
    )  # fmt: skip
    write_steps(rl, range(1, 3))
    run_stage(rl, "rl")
    with tempfile.TemporaryDirectory() as tmp:
        start = load_checkpoint_weights(fetch_checkpoint(sft, 20, Path(tmp) / "sft"))
        version0 = load_checkpoint_weights(
            fetch_checkpoint(run, 0, Path(tmp) / "v0", parent=RunLayout.POLICIES)
        )
    assert version0.keys() == start.keys()
    assert all(torch.equal(version0[name], start[name]) for name in start)
    assert committed_steps(run, RunLayout.POLICIES)[-1] == 2


def test_full_weight_sft_then_lora_rl_trains_a_fresh_adapter_on_its_result(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """`sft.full_weights` with `trainer.lora`: SFT commits whole weights, and an RL stage
    started from that result trains a fresh adapter on it (LoRA RL on a warmed-up model):
    every adapter names the SFT checkpoint as its base, and the first step sees exactly the
    SFT model (a full-weight RL from the same checkpoint computes the same first loss)."""
    write_data(tmp_path / "data.jsonl", 200)
    lora = {"rank": 8, "alpha": 16.0}
    config = sft_config(tmp_path, tiny_model_dir, 10)
    config = config.model_copy(
        update={
            "trainer": config.trainer.model_copy(update={"lora": LoraConfig(**lora)}),
            "sft": config.sft.model_copy(update={"full_weights": True}),
        }
    )
    run_stage(config, "sft")
    sft = stage_store(open_run_store(config), "sft")
    files = set(read_commit(sft, RunLayout.checkpoint_dir(10)).files)
    assert "model.safetensors" in files and "adapter_config.json" not in files
    base = sft.url(RunLayout.checkpoint_dir(10))

    def rl(name: str, **trainer: object) -> PrimeflowConfig:
        rl = make_config(
            tmp_path,
            tiny_model_dir,
            name,
            max_steps=2,
            trainer={"init_checkpoint": base, **trainer},
        )
        write_steps(rl, range(1, 3))
        run_stage(rl, "rl")
        return rl

    on_sft = rl("lora-on-sft", lora=lora)
    full = rl("full-from-sft")
    store = open_run_store(on_sft)
    with tempfile.TemporaryDirectory() as tmp:
        for step in (0, 2):
            folder = fetch_checkpoint(store, step, Path(tmp) / str(step), parent=RunLayout.POLICIES)
            assert (
                json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
                == base
            )
        version0 = load_checkpoint_weights(Path(tmp) / "0")
    assert all(not tensor.any() for name, tensor in version0.items() if ".lora_B." in name)
    first = read_metrics(store, "rl")[0]
    assert first["loss"] == pytest.approx(read_metrics(open_run_store(full), "rl")[0]["loss"])

    # A run whose model is another base (a tenant of shared pools) cannot start a fresh
    # adapter on these whole weights: it would train on the wrong model.
    with pytest.raises(ValueError, match="holds whole weights"):
        load_start_adapter(SimpleNamespace(adapter_base=str(tiny_model_dir)), on_sft, base)  # type: ignore[arg-type]
