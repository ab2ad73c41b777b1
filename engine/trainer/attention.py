"""Document-masked attention for packed rows, plugged into `transformers` models.

A packed row holds several samples; a token must attend only to earlier tokens of its own
sample. When every row of a micro-batch is a single document (a long sample filling its row, or
an all-padding row) that is plain causal attention: SDPA with `is_causal`, which on Hopper runs
cuDNN's fused attention (preferred over FA2 via `sdpa_priority`). Otherwise one of two kernels:

- **GPU (bf16/fp16): FlashAttention-2 varlen** through `torch.nn.attention.varlen.varlen_attn`.
  The micro-batch is flattened to one stream of tokens with cumulative document offsets
  (`cu_seqlens`); the kernel never computes a score across documents, so attention costs
  Σ len² over documents rather than rows × seq_len², needs no mask in memory, and ships with
  PyTorch (no flash-attn build to match against CUDA and torch versions). Flex attention would
  also skip masked blocks but recompiles its block mask per batch and trails FA2 in speed.
- **CPU or fp32: SDPA with a block-diagonal causal mask** [B, 1, S, S]. Exact and simple; it
  does the full S² work, which is fine for tests and the tiny model.

Without packing kwargs (a plain `model(input_ids)` call, e.g. evaluation) the function is
ordinary causal SDPA, so a model loaded with this implementation behaves like a stock one.
The kwargs names carry a `primeflow_` prefix so they never collide with `transformers`' own.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface

varlen_attn: Callable[..., Tensor | tuple[Tensor, Tensor]] | None
try:  # PyTorch ≥ 2.9 ships FlashAttention-2 varlen; older builds fall back to the mask path.
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - depends on the torch build
    varlen_attn = None
_VARLEN_PARAMS = frozenset(inspect.signature(varlen_attn).parameters if varlen_attn else ())

ATTENTION_NAME = "primeflow_packed"
CU_SEQLENS = "primeflow_cu_seqlens"
MAX_LEN = "primeflow_max_len"
DOC_MASK = "primeflow_doc_mask"


def varlen_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the FlashAttention varlen kernel can run for this device and dtype."""
    return (
        varlen_attn is not None
        and device.type == "cuda"
        and dtype in (torch.bfloat16, torch.float16)
    )


def sdpa_priority(device: torch.device) -> AbstractContextManager[None]:
    """On GPU, try cuDNN attention first, then FlashAttention-2, then the others."""
    if device.type != "cuda":
        return nullcontext()
    order = [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]
    return sdpa_kernel(order, set_priority=True)


def document_kwargs(
    doc_lens: Sequence[Sequence[int]], seq_len: int, device: torch.device, varlen: bool
) -> dict[str, Any]:
    """The attention kwargs for a micro-batch whose row r holds documents `doc_lens[r]`.

    none:   every row is one document, so causal attention is already exact.
    varlen: `cu_seqlens` [D+1] int32 over the flattened rows and the longest document.
    mask:   a bool [B, 1, S, S] mask, true where query i may attend key j (same document, j ≤ i).
    """
    if all(len(row) == 1 for row in doc_lens):
        return {}
    lengths = [length for row in doc_lens for length in row]
    if varlen:
        offsets = [0]
        for length in lengths:
            offsets.append(offsets[-1] + length)
        cu = torch.tensor(offsets, dtype=torch.int32, device=device)
        return {CU_SEQLENS: cu, MAX_LEN: max(lengths)}
    doc_ids = torch.cat(
        [torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in doc_lens]
    ).view(len(doc_lens), seq_len)
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    return {DOC_MASK: (same_doc & causal).unsqueeze(1).to(device)}


def _varlen(
    query: Tensor, key: Tensor, value: Tensor, cu: Tensor, max_len: int, scale: float
) -> Tensor:
    """FlashAttention-2 varlen on [T, H, D] tensors, adapting to the installed torch's signature."""
    extra: dict[str, Any] = {}
    if "window_size" in _VARLEN_PARAMS:
        extra["window_size"] = (-1, 0)
    else:
        extra["is_causal"] = True
    if "scale" in _VARLEN_PARAMS:
        extra["scale"] = scale
    else:
        query = query * (scale * math.sqrt(query.shape[-1]))
    if key.shape[1] != query.shape[1]:
        if "enable_gqa" in _VARLEN_PARAMS:
            extra["enable_gqa"] = True
        else:
            groups = query.shape[1] // key.shape[1]
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
    assert varlen_attn is not None  # packed_attention takes this path only where it exists
    out = varlen_attn(query, key, value, cu, cu, max_len, max_len, **extra)
    assert isinstance(out, Tensor)  # a tuple only with return_aux, which is not asked for
    return out


def packed_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """`transformers` attention function: q [B, H, S, D], k/v [B, Hkv, S, D] → [B, S, H, D]."""
    batch, heads, seq_len, head_dim = query.shape
    scale = scaling if scaling is not None else head_dim**-0.5
    cu = kwargs.get(CU_SEQLENS)
    if cu is not None:
        flat_q, flat_k, flat_v = (
            t.transpose(1, 2).reshape(batch * seq_len, t.shape[1], head_dim)
            for t in (query, key, value)
        )
        out = _varlen(flat_q, flat_k, flat_v, cu, kwargs[MAX_LEN], scale)
        return out.view(batch, seq_len, heads, head_dim), None
    mask = kwargs.get(DOC_MASK)
    if key.shape[1] != heads:
        groups = heads // key.shape[1]
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=mask is None, scale=scale
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, packed_attention)
