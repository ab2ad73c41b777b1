"""LoRA adapters made for tests and benchmarks, committed like a run's checkpoints."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from engine.config.trainer import LoraConfig
from engine.trainer.lora import adapter_config, apply_lora, published
from storage.checkpoints import write_checkpoint
from storage.layout import RunLayout
from storage.store import ObjectStore


def random_adapters(
    model: Path,
    lora: LoraConfig,
    roots: Sequence[Path],
    seed: int = 0,
    base: str | None = None,
    *,
    version: int | None = None,
    meta: dict[str, object] | None = None,
) -> list[str]:
    """Committed adapters on `model` whose B is random (PEFT starts it at 0), one under each of
    `roots` (seeds `seed`, `seed + 1`, ...): their URIs. They name `base` as what they were
    trained on (default: `model`). The model is loaded once for all of them. They are resume
    checkpoints at step 0, or with `version`, policy versions of that step, each with a uid
    of its own and `meta` (lineage...), as the trainer publishes them."""
    causal_lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    apply_lora(causal_lm, lora)
    config = adapter_config(lora, base or str(model))
    uris = []
    for index, root in enumerate(roots):
        torch.manual_seed(seed + index)
        tensors = {}
        for name, param in causal_lm.named_parameters():
            if ".lora_B." in name:
                param.data.normal_(std=0.2)
            if param.requires_grad:
                tensors[name] = param.detach()
        store = ObjectStore(f"file://{root}")
        if version is None:
            write_checkpoint(store, 0, weights=published(tensors), config=config, adapter=True)
            uris.append(store.url(RunLayout.checkpoint_dir(0)))
            continue
        write_checkpoint(
            store,
            version,
            weights=published(tensors),
            config=config,
            adapter=True,
            parent=RunLayout.POLICIES,
            meta={"kind": "full", "uid": uuid.uuid4().hex, **(meta or {})},
        )
        uris.append(store.url(RunLayout.policy_dir(version)))
    return uris


def random_adapter(
    model: Path, lora: LoraConfig, root: Path, seed: int = 0, base: str | None = None
) -> str:
    """One adapter of `random_adapters`: its URI."""
    return random_adapters(model, lora, [root], seed, base)[0]
