"""LoRA training: only the adapters train and are published, in PEFT's own layout, and a resume
checkpoint restores them and their optimizer state exactly (one CPU rank, gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from engine.config.trainer import (
    CheckpointConfig,
    ConstantSchedulerConfig,
    LoraConfig,
    OptimizerConfig,
    PolicyConfig,
)
from engine.trainer.batching import micro_batches
from engine.trainer.checkpoint_resume import load_checkpoint
from engine.trainer.checkpoint_writer import CheckpointWriter
from engine.trainer.distributed import init_distributed
from engine.trainer.lora import fresh_adapter, published_name, trainer_name
from engine.trainer.loss import sft_loss
from engine.trainer.model import ModelOptions, PolicyModel, build_policy, load_causal_lm
from engine.trainer.optim import build_optimizer
from engine.trainer.packing import Sample, pack_samples
from engine.trainer.publish import AdapterPublisher
from engine.trainer.schedule import build_scheduler
from engine.trainer.step import StepContext, train_step
from storage.checkpoints import fetch_checkpoint
from storage.layout import RunLayout
from storage.store import ObjectStore

LORA = LoraConfig(rank=4, alpha=8.0)


def build(model_dir: Path, lora: LoraConfig | None = LORA) -> tuple:
    dist = init_distributed("gloo")
    options = ModelOptions(lora=lora)
    policy = build_policy(load_causal_lm(str(model_dir), options), dist.mesh, dist.device, options)
    optimizer = build_optimizer(policy, OptimizerConfig(lr=1e-2), dist.device)
    scheduler = build_scheduler(optimizer, ConstantSchedulerConfig(), 10)
    return dist, policy, optimizer, scheduler


def train(dist, policy, optimizer, scheduler, steps: int = 2) -> None:
    rng = np.random.default_rng(0)
    samples = [
        Sample(rng.integers(0, 100, n), np.ones(n, bool), np.zeros(n, np.float32))
        for n in (30, 20, 40)
    ]
    rows = pack_samples(samples, 64)
    ctx = StepContext(policy=policy, dist=dist, compute_dtype=torch.float32)
    tokens = int(rows.loss_mask.sum())
    for _ in range(steps):
        train_step(ctx, optimizer, scheduler, micro_batches(rows, 2), sft_loss, tokens, 1.0)


def full(policy: PolicyModel) -> dict[str, torch.Tensor]:
    return {
        name: getattr(p, "full_tensor", lambda p=p: p)().detach().clone()
        for name, p in policy.named_parameters()
    }


def test_only_the_adapters_train(tiny_model_dir: Path) -> None:
    dist, policy, optimizer, scheduler = build(tiny_model_dir)
    before = full(policy)
    trainable = {name for name, _ in policy.trainable()}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert sum(len(group["params"]) for group in optimizer.param_groups) == len(trainable)
    train(dist, policy, optimizer, scheduler)
    after = full(policy)
    frozen = [name for name in before if name not in trainable]
    assert all(torch.equal(before[name], after[name]) for name in frozen)
    moved = [name for name in trainable if ".lora_B." in name]
    assert all(before[name].abs().sum() == 0 for name in moved)  # B starts at 0: the base
    assert all(after[name].abs().sum() > 0 for name in moved)


def test_names_round_trip_to_peft_s_layout() -> None:
    name = "model.layers.0.self_attn.q_proj.lora_A.default.weight"
    peft = published_name(name)
    assert peft == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert trainer_name(peft) == name
    with pytest.raises(ValueError, match="not a parameter of adapter"):
        published_name("model.layers.0.self_attn.q_proj.base_layer.weight")


@pytest.fixture
def trained(tiny_model_dir: Path, tmp_path: Path) -> tuple:
    """A LoRA policy two steps in, with its optimizer and schedule, and a run store."""
    dist, policy, optimizer, scheduler = build(tiny_model_dir)
    train(dist, policy, optimizer, scheduler)
    return dist, policy, optimizer, scheduler, ObjectStore(f"file://{tmp_path}/run")


def test_a_published_adapter_is_peft_s_folder_with_the_trainer_s_bits(
    trained: tuple, tiny_model_dir: Path, tmp_path: Path
) -> None:
    dist, policy, optimizer, _, store = trained
    publisher = AdapterPublisher(
        store, policy, optimizer, dist, config=PolicyConfig(), files={}, lineage=0
    )
    metrics = publisher.publish(2)
    publisher.flush()
    folder = tmp_path / "run" / RunLayout.policy_dir(2)
    assert {p.name for p in folder.iterdir()} == {
        "adapter_config.json", "adapter_model.safetensors", "_COMMITTED"
    }  # fmt: skip
    stored = load_file(folder / "adapter_model.safetensors")
    trained = full(policy)
    assert metrics["policy_bytes"] == sum(t.numel() * t.element_size() for t in stored.values())
    assert stored.keys() == {published_name(name) for name, _ in policy.trainable()}
    assert all(torch.equal(stored[published_name(n)], trained[n]) for n, _ in policy.trainable())
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"

    # PEFT itself loads it onto the base: the adapter changes the logits, B·A as trained.
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    plain = base(ids).logits
    tuned = PeftModel.from_pretrained(base, folder)
    assert not torch.allclose(tuned(ids).logits, plain)


def test_a_resume_checkpoint_restores_adapters_and_optimizer_exactly(
    trained: tuple, tiny_model_dir: Path, tmp_path: Path
) -> None:
    dist, policy, optimizer, scheduler, store = trained
    writer = CheckpointWriter(
        store, policy, optimizer, scheduler, dist, files={}, config=CheckpointConfig()
    )
    writer.save(2, {"step": 2})
    writer.flush()
    folder = fetch_checkpoint(store, 2, tmp_path / "fetched", trainer_state=True)
    assert (folder / "adapter_config.json").is_file() and not (folder / "config.json").exists()
    assert not list(folder.glob("model*.safetensors")), "the base is never rewritten"

    _, again, optimizer2, scheduler2 = build(tiny_model_dir)
    assert load_checkpoint(store, 2, again, optimizer2, scheduler2, dist) == {"step": 2}
    expected, restored = full(policy), full(again)
    assert all(torch.equal(expected[name], restored[name]) for name in expected)
    moments = [
        (optimizer.state[a]["exp_avg"], optimizer2.state[b]["exp_avg"])
        for a, b in zip(
            [p for _, p in policy.trainable()], [p for _, p in again.trainable()], strict=True
        )
    ]
    assert all(torch.equal(x.full_tensor(), y.full_tensor()) for x, y in moments)


def test_a_fresh_adapter_is_peft_s_init_drawn_from_the_seed_alone() -> None:
    shapes = {
        "model.layers.0.mlp.up_proj.lora_A.default.weight": (4, 64),
        "model.layers.0.mlp.up_proj.lora_B.default.weight": (128, 4),
    }
    a_name, b_name = shapes
    first, again, other = (fresh_adapter(shapes, seed) for seed in (7, 7, 8))
    assert all(torch.equal(first[k], again[k]) for k in shapes)  # a tenant starts alike anywhere
    assert not torch.equal(first[a_name], other[a_name])
    assert torch.count_nonzero(first[b_name]) == 0  # B = 0: the adapter starts as the base
    # Kaiming-uniform with a = sqrt(5), as PEFT's LoRA A: bound 1 / sqrt(fan_in).
    bound = 1 / np.sqrt(64)
    assert first[a_name].abs().max() <= bound and first[a_name].abs().max() > 0.9 * bound
