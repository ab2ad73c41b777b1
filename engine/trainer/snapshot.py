"""What a policy publication reads off the trainer: the weights in the serving dtype.

Full versions gather every parameter on the device, one at a time, to the host of the rank that
writes it (`snapshot_weights`); deltas compare, on the device, the rows each rank owns of every
parameter end to end in one stream (`OwnedStream`), and copy only the changed entries through
one pinned host buffer (`Staging`). The cast is the one a server makes (`Tensor.to`, round to
nearest even), so the served weights are bit-identical to the trainer's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from engine.trainer.distributed import DistInfo
from engine.trainer.host_copies import Fence, HostCopies
from storage.deltas import (
    Part,
)


def serving_dtype(config: Any) -> torch.dtype:
    """The dtype a server loads the model in: the model config's (`dtype`), fp32 if unset."""
    name = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(name, torch.dtype):
        return name
    return getattr(torch, str(name)) if name and str(name) != "auto" else torch.float32


def snapshot_weights(
    params: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    dist_info: DistInfo,
    owners: Mapping[str, int] | None = None,
) -> tuple[dict[str, torch.Tensor], Fence]:
    """Full tensors in `dtype` on the host of the rank that owns each (`owners`; rank 0 when
    None), none elsewhere, and the fence of their copies; collective.

    One parameter is gathered at a time (`HostCopies`), cast on the device.
    """
    weights = HostCopies(dist_info)
    for name, tensor in params:
        keep = (owners or {}).get(name, 0) == dist_info.rank
        weights.add(name, tensor, keep=keep, dtype=dtype)
    return weights.done()


def _owned(tensor: torch.Tensor, dist_info: DistInfo) -> tuple[torch.Tensor, int] | None:
    """This rank's rows of a (sharded) parameter and their flat offset; None if it owns none.

    FSDP2 shards dim 0; a replicated or plain tensor belongs to rank 0, so it is written once.
    """
    if not isinstance(tensor, DTensor):
        return (tensor, 0) if dist_info.is_main else None
    placements = tuple(tensor.placements)
    if all(isinstance(p, Replicate) for p in placements):
        return (tensor.to_local(), 0) if dist_info.is_main else None
    if placements != (Shard(0),):
        raise ValueError(f"cannot publish a tensor placed as {placements} (FSDP2 shards dim 0)")
    _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, placements)
    return tensor.to_local(), offset[0] * math.prod(tensor.shape[1:])


class OwnedStream:
    """The rows this rank owns of every tensor, end to end in one flat tensor (`storage.deltas`).

    Laid out once from the sharded parameters (FSDP2 keeps them); `cast` fills a fresh stream
    in the serving dtype on the device: one copy kernel a tensor, no collective, no host copy.
    """

    def __init__(
        self, params: list[tuple[str, torch.Tensor]], dtype: torch.dtype, dist_info: DistInfo
    ) -> None:
        self.dtype = dtype
        self.device = dist_info.device
        self.parts: list[Part] = []
        self._locals: list[torch.Tensor] = []
        for name, tensor in params:
            owned = _owned(tensor, dist_info)
            if owned is not None and owned[0].numel():
                local, offset = owned
                self.parts.append(Part(name, tuple(tensor.shape), dtype, offset, local.numel()))
                self._locals.append(local)
        self.numel = sum(part.size for part in self.parts)

    def cast(self) -> torch.Tensor:
        """(numel,) the owned rows now, in the serving dtype (round to nearest even)."""
        stream = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        for chunk, local in zip(
            stream.split([p.size for p in self.parts]), self._locals, strict=True
        ):
            chunk.copy_(local.detach().reshape(-1))
        return stream


class Staging:
    """One host buffer for a delta's entries, pinned on CUDA, grown as needed.

    Allocating pinned memory is slow (a delta's size changes every step, which misses torch's
    cache); one publication is in flight at a time, so the next snapshot reuses the buffer
    once the previous write is done.
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._buffer = torch.empty(0, dtype=torch.uint8, pin_memory=pin)

    def copy(self, data: torch.Tensor) -> np.ndarray:
        """A host copy of (n,) uint8 `data` (a view of the buffer, valid until the next)."""
        if self._buffer.numel() < data.numel():
            size = int(data.numel() * 1.25)
            self._buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        host = self._buffer[: data.numel()]
        host.copy_(data, non_blocking=self.pin)
        if self.pin:
            torch.cuda.synchronize(data.device)
        return host.numpy()
