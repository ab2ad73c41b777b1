"""The offline tiny model: a small Qwen3 with seeded random weights, written as a HF folder.

Tests and the demo need a real model that `transformers`, vLLM and the trainer all load, on any
machine, with no hub. This factory writes one from a `TinyModelSpec`: `config.json`,
`generation_config.json`, `model.safetensors` and the character-level ChatML tokenizer. The same
spec always yields the same bytes (weights come from a seeded generator in a fixed order, not
from `transformers`' init code), so a cached copy can be named by the spec's hash.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config.model import TINY_MODEL
from engine.models.char_tokenizer import (
    CHARACTERS,
    ENDOFTEXT,
    IM_END,
    SPECIAL_TOKENS,
    write_tokenizer,
)

# torch, safetensors and transformers load only where the model is built: a process that names
# the offline model (a flow run's, the CLI's) finds its cached folder without them.
if TYPE_CHECKING:
    import torch
    from transformers import Qwen3Config

#: Bump when the factory's output changes for an unchanged spec, so stale caches are not reused.
FACTORY_VERSION = 2  # 2: the chat template renders tools and tool calls


@dataclass(frozen=True)
class TinyModelSpec:
    """Everything that determines the tiny model's bytes.

    The defaults are the demo's model (~0.44M parameters). `head_dim` stays 64 because vLLM's
    CPU attention rejects smaller heads; `init_std` > the usual 0.02 gives sharper output
    distributions, which tests use to make log-prob comparisons meaningful.
    """

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 384
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    dtype: str = "float32"
    init_std: float = 0.02
    seed: int = 0

    def digest(self) -> str:
        """A short hash of the spec and the factory version: the cache folder's name."""
        payload = json.dumps({"factory": FACTORY_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def qwen3_config(spec: TinyModelSpec) -> Qwen3Config:
    """The `transformers` config of the tiny model, with the tokenizer's special token ids."""
    from transformers import Qwen3Config

    vocab_size = len(SPECIAL_TOKENS) + len(CHARACTERS)
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index(IM_END),
        pad_token_id=SPECIAL_TOKENS.index(ENDOFTEXT),
        dtype=spec.dtype,
        architectures=["Qwen3ForCausalLM"],
    )


def tiny_state_dict(spec: TinyModelSpec) -> dict[str, torch.Tensor]:
    """Seeded weights for every parameter the HF model owns (the tied head is stored once).

    Norm scales start at 1; every other tensor is N(0, init_std²), drawn in sorted name order
    from one generator, so the result depends only on the spec.
    """
    # Imported here: the model class pulls in transformers' Qwen3 modeling (~1.6 s on the
    # 2-core machine), which every process that only names or finds a built model would pay.
    import torch
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        model = Qwen3ForCausalLM(qwen3_config(spec))
    shapes = {name: tuple(param.shape) for name, param in model.named_parameters()}
    generator = torch.Generator().manual_seed(spec.seed)
    weights = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            tensor = torch.ones(shapes[name])
        else:
            tensor = torch.randn(shapes[name], generator=generator) * spec.init_std
        weights[name] = tensor.to(getattr(torch, spec.dtype)).contiguous()
    return weights


def write_tiny_model(folder: Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write the tiny model (weights, configs, tokenizer) into `folder` and return it."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = qwen3_config(spec)
    config.to_json_file(str(folder / "config.json"))
    generation = {
        "eos_token_id": [config.eos_token_id, config.pad_token_id],
        "pad_token_id": config.pad_token_id,
    }
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(tiny_state_dict(spec), str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(folder, model_max_length=spec.max_position_embeddings)
    return folder


#: The offline models primeflow builds itself, by the name a config gives as `model.name`. All
#: share the character-level tokenizer; the larger two are for GPUs (bf16 weights).
BUILTIN_MODELS: dict[str, TinyModelSpec] = {
    # The CPU demo's and the tests' model (~0.44M parameters).
    TINY_MODEL: TinyModelSpec(),
    # ~76M parameters (12 x 768, GQA 12/4): the GPU demo, worth a GPU and learning in minutes.
    "primeflow/qwen3-char-76m": TinyModelSpec(
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=2048,
        dtype="bfloat16",
    ),
    # Qwen3-0.6B's body (28 x 1024, GQA 16/8, head_dim 128; ~0.44B with the char vocabulary):
    # the GPU tests and benchmarks run the real model's shapes without its hub weights.
    "primeflow/qwen3-0.6b-body": TinyModelSpec(
        hidden_size=1024,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=3072,
        dtype="bfloat16",
    ),
}


def default_cache_dir() -> Path:
    """`$PRIMEFLOW_CACHE` or `$XDG_CACHE_HOME/primeflow` (default `~/.cache/primeflow`)."""
    if root := os.environ.get("PRIMEFLOW_CACHE"):
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "primeflow"


def cached_tiny_model(spec: TinyModelSpec = TinyModelSpec(), cache_dir: Path | None = None) -> Path:
    """The tiny model's folder in the cache, built on first use.

    It is built in a temporary sibling and renamed into place, so concurrent callers (test
    workers, the trainer and the inference pool starting together) never see a partial folder.
    """
    target = (cache_dir or default_cache_dir()) / "models" / spec.digest()
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write_tiny_model(scratch, spec)
        os.replace(scratch, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target
