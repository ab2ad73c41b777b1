"""Sets of safetensors files in the Hugging Face layout: one file, or shards plus an index.

Tensors cross storage only as safetensors, never pickles. The Hugging Face layout
(`model.safetensors`, or `model-00001-of-00003.safetensors` + `model.safetensors.index.json`)
is what `transformers` and vLLM load without conversion. Shards are produced one at a time so
that a writer holds at most one serialised shard in memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save

# safetensors files carry this so that transformers accepts them as PyTorch weights.
_METADATA = {"format": "pt"}
# Hugging Face ties the output head to the input embeddings on load when the config says so.
_TIED_HEAD_SUFFIX = "lm_head.weight"


def index_name(stem: str) -> str:
    return f"{stem}.safetensors.index.json"


def _view_key(tensor: torch.Tensor) -> tuple[object, ...]:
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def prepare_tensors(
    tensors: Mapping[str, torch.Tensor], *, tie_word_embeddings: bool
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors safetensors accepts (CPU, contiguous, no shared memory), and the aliases dropped.

    safetensors refuses tensors that share memory. A tied output head (`lm_head.weight` being
    the embedding matrix) is dropped when the config ties word embeddings, exactly as
    `save_pretrained` does, and reported in the returned `{dropped: kept}` aliases; any other
    sharing is resolved by storing a copy, so that no name is ever lost.
    """
    prepared: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    views: dict[tuple[object, ...], str] = {}
    storages: set[int] = set()
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        value = tensor.detach().cpu()
        if value.numel() == 0:
            prepared[name] = value.clone()
            continue
        key = _view_key(value)
        if key in views and tie_word_embeddings and name.endswith(_TIED_HEAD_SUFFIX):
            aliases[name] = views[key]
            continue
        if not value.is_contiguous():
            value = value.contiguous()
        elif key[0] in storages:
            value = value.clone()
        views.setdefault(_view_key(value), name)
        storages.add(value.untyped_storage().data_ptr())
        prepared[name] = value
    return prepared, aliases


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _plan(tensors: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Names grouped greedily in order; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name, tensor in tensors.items():
        size = _tensor_bytes(tensor)
        if shards[-1] and filled + size > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += size
    return shards


def encode_tensor_files(
    tensors: Mapping[str, torch.Tensor], stem: str, *, max_shard_bytes: int
) -> Iterator[tuple[str, bytes]]:
    """Yield (file name, bytes) of the safetensors set for `tensors`, one shard at a time."""
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    plan = _plan(tensors, max_shard_bytes)
    if len(plan) == 1:
        yield f"{stem}.safetensors", save({n: tensors[n] for n in plan[0]}, metadata=_METADATA)
        return
    weight_map: dict[str, str] = {}
    for number, names in enumerate(plan, start=1):
        file_name = f"{stem}-{number:05d}-of-{len(plan):05d}.safetensors"
        weight_map.update(dict.fromkeys(names, file_name.rsplit("/", 1)[-1]))
        yield file_name, save({n: tensors[n] for n in names}, metadata=_METADATA)
    total = sum(_tensor_bytes(tensor) for tensor in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    yield index_name(stem), json.dumps(index, indent=2, sort_keys=True).encode()


def load_tensor_files(folder: Path, stem: str) -> dict[str, torch.Tensor]:
    """Load the set written by `encode_tensor_files` (or by `save_pretrained`) from `folder`."""
    index_path = folder / index_name(stem)
    if not index_path.is_file():
        return load_file(folder / f"{stem}.safetensors")
    weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
    base = (folder / stem).parent
    tensors: dict[str, torch.Tensor] = {}
    for file_name in sorted(set(weight_map.values())):
        tensors.update(load_file(base / file_name))
    return tensors
