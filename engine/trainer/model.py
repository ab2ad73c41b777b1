"""Load a Hugging Face causal LM and shard it with FSDP2 for training.

The trained module is a `PolicyModel`: the HF model's decoder and LM head, re-parented without
renaming, so its parameter names (`model.layers.0.mlp.up_proj.weight`, `lm_head.weight`) are
exactly the HF checkpoint's. Its forward returns per-token log-probs and entropies instead of
logits (`engine.trainer.logprobs`), and it passes packing information to the attention function
(`engine.trainer.attention`).

FSDP2 layout (as torchtitan): `fully_shard` on every transformer block, then on the root, which
holds the embeddings, final norm and LM head (tied or not). On GPU the parameters are fp32
masters sharded across ranks, gathered as bf16 for compute, with gradients reduced in fp32
(`MixedPrecisionPolicy`); on CPU everything is fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from engine.config.trainer import LoraConfig
from engine.models import resolve_model
from engine.trainer.attention import ATTENTION_NAME
from engine.trainer.logprobs import target_logprobs
from engine.trainer.lora import apply_lora


@dataclass(frozen=True)
class ModelOptions:
    """How to build the trained model (resolved from `TrainerConfig` and the device)."""

    compute_dtype: torch.dtype = torch.float32
    activation_checkpointing: bool = False
    compile: bool = False
    trust_remote_code: bool = False
    revision: str | None = None
    #: Train LoRA adapters (`engine.trainer.lora`) instead of every weight.
    lora: LoraConfig | None = None


def compute_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`trainer.dtype`: auto is bf16 on GPU and fp32 on CPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]


def load_causal_lm(name: str, options: ModelOptions) -> PreTrainedModel:
    """fp32 HF model from a hub id, local folder or `primeflow/tiny-qwen3`, on CPU.

    The config keeps the dtype the model was published in, so checkpoints written from it are
    still served in that dtype although the trainer's master weights are fp32.
    """
    path = resolve_model(name)
    kwargs: dict[str, Any] = {
        "trust_remote_code": options.trust_remote_code,
        "revision": options.revision,
    }
    published = AutoConfig.from_pretrained(path, **kwargs).dtype
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=ATTENTION_NAME, **kwargs
    )
    model.config.use_cache = False
    model.config.dtype = published
    return model


def causal_lm_from_config(config: PretrainedConfig, seed: int = 0) -> PreTrainedModel:
    """fp32 HF model with random weights (benchmarks and tests of a model's shape)."""
    torch.manual_seed(seed)
    config.use_cache = False
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation=ATTENTION_NAME
    )
    return cast(PreTrainedModel, model)


class PolicyModel(nn.Module):
    """A causal LM's decoder + LM head, returning log-probs of given targets rather than logits."""

    #: The adapters `build_policy` added (None: every weight trains).
    lora: LoraConfig | None = None
    #: What the adapters apply to, as configured (`engine.trainer.build.adapter_base`; by
    #: default where the model was loaded from): every adapter's `base_model_name_or_path`.
    adapter_base: str

    def __init__(self, causal_lm: PreTrainedModel) -> None:
        super().__init__()
        head = causal_lm.get_output_embeddings()
        if not isinstance(head, nn.Linear):
            raise ValueError(f"{type(causal_lm).__name__}: the LM head must be an nn.Linear")
        children = dict(causal_lm.named_children())
        head_name = next(name for name, module in children.items() if module is head)
        self.base_name = causal_lm.base_model_prefix
        self.add_module(self.base_name, children[self.base_name])
        self.add_module(head_name, head)
        self.head_name = head_name
        self.config = causal_lm.config
        self.adapter_base = causal_lm.config.name_or_path or ""  # '' unless loaded from one

    @property
    def base(self) -> PreTrainedModel:
        return cast(PreTrainedModel, getattr(self, self.base_name))  # the causal LM's decoder

    @property
    def head(self) -> nn.Linear:
        return cast(nn.Linear, getattr(self, self.head_name))  # checked in __init__

    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters the optimizer steps: every one, or a LoRA run's adapters."""
        return [(name, p) for name, p in self.named_parameters() if p.requires_grad]

    @property
    def blocks(self) -> nn.ModuleList:
        """The transformer blocks, the unit of sharding, checkpointing and compilation."""
        layers = getattr(self.base, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise ValueError(f"{type(self.base).__name__} has no `layers` ModuleList to shard")
        return layers

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        targets: Tensor,
        temperatures: Tensor,
        **attention_kwargs: Any,
    ) -> tuple[Tensor, Tensor]:
        """ids, positions, targets [B, S] int64, temperatures [B, S] → log-probs, entropy [B·S].

        The outputs are flat (not views of [B, S]): FSDP2 hooks outputs for backward, and a view
        would let an in-place op on it skip that hook.
        """
        hidden = self.base(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, **attention_kwargs
        ).last_hidden_state
        batch, seq_len, width = hidden.shape
        return target_logprobs(
            hidden.reshape(batch * seq_len, width),
            self.head.weight,
            targets.reshape(-1),
            temperatures.reshape(-1),
        )


def apply_activation_checkpointing(causal_lm: PreTrainedModel) -> None:
    """Recompute each block in backward (non-reentrant, so it composes with FSDP2 and compile)."""
    kwargs = {"use_reentrant": False}
    enable = getattr(causal_lm, "activation_checkpointing_enable", None)
    if enable is not None:  # transformers ≥ 5.2x; the older name is deprecated there
        enable(kwargs)
    else:
        causal_lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def compile_blocks(policy: PolicyModel) -> None:
    """Compile each block's forward; FSDP2's hooks stay outside the compiled region.

    Dynamic from the first step: a step's packed rows, its documents and its longest document
    change from step to step, and a graph compiled for the first shapes is compiled again when
    each of them first changes (7-10 s on an H200 each time, mid-run). A micro-batch of one
    row still gets a graph of its own (torch specializes sizes of 1), once.
    """
    for block in policy.blocks:
        block.forward = torch.compile(block.forward, dynamic=True)


def shard(policy: PolicyModel, mesh: DeviceMesh, compute: torch.dtype) -> None:
    """FSDP2: one unit per block, then the root (embeddings, norm, LM head).

    The last block keeps its gathered parameters after forward: backward needs them first, so
    freeing and gathering them again would only add an all-gather that nothing hides (as
    torchtitan; FSDP2 already does this for the root). Each unit's all-gather is issued
    explicitly one unit ahead, in forward (block i gathers block i + 1 before its own compute)
    and in backward (block i gathers block i - 1), so that it overlaps the current unit's compute.
    """
    policy_kwargs: dict[str, Any] = {}
    if compute != torch.float32:
        policy_kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=compute, reduce_dtype=torch.float32
        )
    blocks = list(policy.blocks)
    for index, block in enumerate(blocks):
        last = index == len(blocks) - 1
        fully_shard(block, mesh=mesh, reshard_after_forward=not last, **policy_kwargs)
    fully_shard(policy, mesh=mesh, **policy_kwargs)
    units = [cast(FSDPModule, block) for block in blocks]
    if units:
        cast(FSDPModule, policy).set_modules_to_forward_prefetch(units[:1])
    for previous, unit in pairwise(units):
        previous.set_modules_to_forward_prefetch([unit])
        unit.set_modules_to_backward_prefetch([previous])


def build_policy(
    causal_lm: PreTrainedModel, mesh: DeviceMesh, device: torch.device, options: ModelOptions
) -> PolicyModel:
    """Move the fp32 model to `device`, then add adapters, checkpoint, compile and shard it as
    configured (adapters first: FSDP2 fixes a unit's parameters when it shards it)."""
    if options.lora is not None:
        apply_lora(causal_lm, options.lora)
    if options.activation_checkpointing:
        apply_activation_checkpointing(causal_lm)
    causal_lm.train()
    policy = PolicyModel(causal_lm).to(device)
    policy.lora = options.lora
    if options.compile:
        compile_blocks(policy)
    shard(policy, mesh, options.compute_dtype)
    return policy
