"""Sets of safetensors files in the Hugging Face layout: one file, or shards plus an index.

Tensors cross storage only as safetensors, never pickles. The Hugging Face layout
(`model.safetensors`, or `model-00001-of-00003.safetensors` + `model.safetensors.index.json`)
is what `transformers` and vLLM load without conversion.

Files are streamed rather than serialised: each is described as its pieces — the 8-byte header
length, the JSON header, then every tensor's own memory — which a writer passes straight to the
destination, so no copy of the file is ever built (`safetensors.torch.save` copies every tensor
into one buffer the size of the file first). The bytes are exactly the ones `save` produces:
same header (tensors ordered by descending dtype, then name; padded with spaces to 8 bytes),
same data layout.
"""

from __future__ import annotations

import functools
import json
import struct
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

# torch loads where tensors are handled, not on import: a flow run's process uses this
# package's names and layout only, and torch costs it ~1.3 s on 2 cores.
if TYPE_CHECKING:
    import torch

# safetensors' dtype names, in the order of its `Dtype` enum: a file lists (and lays out) its
# tensors by descending dtype in this order, then by name. Dtypes this torch lacks are skipped.
_DTYPE_ORDER = (
    ("bool", "BOOL"),
    ("uint8", "U8"),
    ("int8", "I8"),
    ("float8_e5m2", "F8_E5M2"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
    ("int16", "I16"),
    ("uint16", "U16"),
    ("float16", "F16"),
    ("bfloat16", "BF16"),
    ("int32", "I32"),
    ("uint32", "U32"),
    ("float32", "F32"),
    ("complex64", "C64"),
    ("float64", "F64"),
    ("int64", "I64"),
    ("uint64", "U64"),
)


@functools.cache
def _dtypes() -> dict[torch.dtype, tuple[int, str]]:
    import torch

    return {
        getattr(torch, attr): (rank, name)
        for rank, (attr, name) in enumerate(_DTYPE_ORDER)
        if hasattr(torch, attr)
    }


# Pieces of one file: header length and header, then each tensor's bytes, in file order.
Pieces = list[bytes | memoryview]

# safetensors files carry this so that transformers accepts them as PyTorch weights.
_METADATA = {"format": "pt"}
# Hugging Face ties the output head to the input embeddings on load when the config says so.
_TIED_HEAD_SUFFIX = "lm_head.weight"


def ties_word_embeddings(config: Mapping[str, object]) -> bool:
    """Whether a Hugging Face config dict (`config.json`, `PretrainedConfig.to_dict()`) ties
    the output head to the input embeddings, so that the head is stored once, as the
    embedding. The one place that reads it: the trainer, the checkpoint writer, the pool's
    compatibility check and the server's reload all ask here. A multimodal config keeps it in
    `text_config`."""
    text_config = config.get("text_config")
    nested = text_config.get("tie_word_embeddings") if isinstance(text_config, Mapping) else None
    return bool(config.get("tie_word_embeddings", nested or False))


def shard_file_name(stem: str, number: int, total: int) -> str:
    """The Hugging Face name of file `number` (from 1) of `total` in the set `stem`."""
    return f"{stem}-{number:05d}-of-{total:05d}.safetensors"


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
    import torch

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


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's own memory as bytes, without a copy (it is contiguous on the CPU)."""
    import torch

    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data.cast("B")


def safetensors_pieces(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> Pieces:
    """The pieces of the safetensors file `safetensors.torch.save(tensors, metadata)` would
    return, whose concatenation is byte for byte that file; tensors are not copied.

    Tensors must not share memory (see `prepare_tensors`). A dtype this module does not know,
    or a big-endian machine, falls back to `save` (one piece).
    """
    dtypes = _dtypes()
    if sys.byteorder != "little" or any(t.dtype not in dtypes for t in tensors.values()):
        from safetensors.torch import save

        return [save(dict(tensors), metadata=dict(metadata) if metadata else None)]
    names = sorted(tensors, key=lambda name: (-dtypes[tensors[name].dtype][0], name))
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    pieces: Pieces = []
    offset = 0
    for name in names:
        tensor = tensors[name]
        data = _raw_bytes(tensor)
        header[name] = {
            "dtype": dtypes[tensor.dtype][1],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + data.nbytes],
        }
        offset += data.nbytes
        pieces.append(data)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return [struct.pack("<Q", len(text)) + text, *pieces]


def encode_tensor_files(
    tensors: Mapping[str, torch.Tensor], stem: str, *, max_shard_bytes: int
) -> Iterator[tuple[str, Pieces]]:
    """Yield (file name, pieces) of the safetensors set for `tensors`, one shard at a time.

    Writing a file's pieces in order writes the file; the pieces are views of the tensors.
    """
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    plan = _plan(tensors, max_shard_bytes)
    if len(plan) == 1:
        yield f"{stem}.safetensors", safetensors_pieces(tensors, _METADATA)
        return
    weight_map: dict[str, str] = {}
    for number, names in enumerate(plan, start=1):
        file_name = shard_file_name(stem, number, len(plan))
        weight_map.update(dict.fromkeys(names, file_name.rsplit("/", 1)[-1]))
        yield file_name, safetensors_pieces({n: tensors[n] for n in names}, _METADATA)
    total = sum(_tensor_bytes(tensor) for tensor in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    yield index_name(stem), [json.dumps(index, indent=2, sort_keys=True).encode()]


def load_tensor_files(folder: Path, stem: str) -> dict[str, torch.Tensor]:
    """Load the set written by `encode_tensor_files` (or by `save_pretrained`) from `folder`."""
    from safetensors.torch import load_file

    index_path = folder / index_name(stem)
    if not index_path.is_file():
        return load_file(folder / f"{stem}.safetensors")
    weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
    base = (folder / stem).parent
    tensors: dict[str, torch.Tensor] = {}
    for file_name in sorted(set(weight_map.values())):
        tensors.update(load_file(base / file_name))
    return tensors
