"""LoRA adapters made for tests and benchmarks, committed like a run's checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from engine.config.trainer import LoraConfig
from engine.trainer.lora import adapter_config, apply_lora, published
from storage.checkpoints import write_checkpoint
from storage.layout import RunLayout
from storage.store import ObjectStore


def random_adapter(
    model: Path, lora: LoraConfig, root: Path, seed: int = 0, base: str | None = None
) -> str:
    """A committed adapter on `model` whose B is random (PEFT starts it at 0): its URI. It
    names `base` as what it was trained on (default: `model`)."""
    causal_lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    apply_lora(causal_lm, lora)
    torch.manual_seed(seed)
    tensors = {}
    for name, param in causal_lm.named_parameters():
        if ".lora_B." in name:
            param.data.normal_(std=0.2)
        if param.requires_grad:
            tensors[name] = param.detach()
    store = ObjectStore(f"file://{root}")
    config = adapter_config(lora, base or str(model))
    write_checkpoint(store, 0, weights=published(tensors), config=config, adapter=True)
    return store.url(RunLayout.checkpoint_dir(0))
