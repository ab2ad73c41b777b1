"""LoRA adapters through PEFT: injected into the Hugging Face model before it is wrapped and
sharded, named the way PEFT and vLLM store them when published.

`peft.inject_adapter_in_model` changes the model in place (no `PeftModel` wrapper), so the
`PolicyModel` re-parenting, FSDP2's per-block units and compilation see the same module tree
and parameter names as for full-weight training, plus `lora_A`/`lora_B` inside each targeted
projection. The base weights are frozen; FSDP2 shards frozen and trainable parameters of a
block together and reduces gradients only for the trainable ones.

Names: inside the trainer a parameter is `model.layers.0.self_attn.q_proj.lora_A.default.weight`;
in a published adapter (`adapter_model.safetensors`, what `PeftModel.save_pretrained` writes and
vLLM's runtime LoRA loading reads) it is
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.

    r = rank, α = alpha:  y = W·x + (α / r) · B·(A·x),   A [r, in], B [out, r], B = 0 at start
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import inject_adapter_in_model
from torch import Tensor, nn
from transformers import PreTrainedModel

from engine.config.trainer import LoraConfig

#: PEFT's name for the one adapter the trainer holds.
ADAPTER_NAME = "default"
_PEFT_PREFIX = "base_model.model."
_ADAPTER_INFIX = f".{ADAPTER_NAME}."


def peft_config(config: LoraConfig, base_model: str | None = None) -> PeftLoraConfig:
    """PEFT's config for `config` (no bias, no extra trained modules: what vLLM serves)."""
    return PeftLoraConfig(
        r=config.rank,
        # PEFT annotates lora_alpha as int, but scales by alpha / r: a float alpha works.
        lora_alpha=config.alpha,  # type: ignore[arg-type]
        lora_dropout=config.dropout,
        target_modules=list(config.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
    )


def apply_lora(causal_lm: PreTrainedModel, config: LoraConfig) -> None:
    """Inject the adapters into `causal_lm` in place and freeze everything else.

    Raises `ValueError` when a target module names nothing in the model, so a typo does not
    train an adapter-less (frozen) model.
    """
    try:
        inject_adapter_in_model(peft_config(config), causal_lm, adapter_name=ADAPTER_NAME)
    except ValueError as exc:
        first = str(exc).splitlines()[0]
        raise ValueError(f"trainer.lora.target_modules: {first}") from None
    trainable = [name for name, p in causal_lm.named_parameters() if p.requires_grad]
    if not trainable or any(".lora_" not in name for name in trainable):
        raise ValueError(f"LoRA left unexpected trainable parameters: {trainable[:3]}")


def fresh_adapter(shapes: Mapping[str, tuple[int, ...]], seed: int) -> dict[str, Tensor]:
    """A new adapter as PEFT initialises one (A Kaiming-uniform, B = 0, so it starts as the
    base model), drawn from `seed` alone: a tenant of a shared trainer starts from the same
    adapter whichever tenants trained before it. `shapes`: trainer name → full shape."""
    generator = torch.Generator().manual_seed(seed)
    adapter = {}
    for name in sorted(shapes):
        tensor = torch.zeros(shapes[name])
        if ".lora_A." in name:
            nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)
        adapter[name] = tensor
    return adapter


def adapter_config(config: LoraConfig, base_model: str) -> dict[str, Any]:
    """`adapter_config.json` of a published adapter, as `PeftModel.save_pretrained` writes it."""
    document = peft_config(config, base_model).to_dict()
    document["inference_mode"] = True
    return {
        key: sorted(value) if isinstance(value, set) else value for key, value in document.items()
    }


def published_name(name: str) -> str:
    """A trainer parameter's name in a published adapter file."""
    if _ADAPTER_INFIX not in name:
        raise ValueError(f"{name!r} is not a parameter of adapter {ADAPTER_NAME!r}")
    return _PEFT_PREFIX + name.replace(_ADAPTER_INFIX, ".", 1)


def published(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Trainer-named adapter tensors under their published names."""
    return {published_name(name): tensor for name, tensor in tensors.items()}


def trainer_name(name: str) -> str:
    """A published adapter tensor's name inside the trainer (`published_name`'s inverse)."""
    if not name.startswith(_PEFT_PREFIX) or not name.endswith(".weight"):
        raise ValueError(f"{name!r} is not a PEFT adapter tensor name")
    stem = name.removeprefix(_PEFT_PREFIX).removesuffix(".weight")
    return f"{stem}{_ADAPTER_INFIX}weight"
