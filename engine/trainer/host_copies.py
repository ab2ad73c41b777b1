"""Full tensors gathered one at a time and copied to the host of the rank that keeps them.

A resume checkpoint and a full policy version are both snapshotted this way after the
optimizer step: each parameter (or optimizer moment) is gathered on the device on its own (a
collective for a DTensor, so every rank takes part), so no rank ever holds a second copy of the
model on the device; only the rank that writes it keeps a host copy. Host copies go to pinned
memory on CUDA, issued without waiting and synchronised once at the end.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from engine.trainer.distributed import DistInfo


class HostCopies:
    """The host copies this rank keeps of the tensors passed to `add`."""

    def __init__(self, dist_info: DistInfo) -> None:
        self.dist_info = dist_info
        self.pin = dist_info.device.type == "cuda"
        self.tensors: dict[str, torch.Tensor] = {}

    def add(
        self, name: str, tensor: torch.Tensor, *, keep: bool, dtype: torch.dtype | None = None
    ) -> None:
        """Gather `tensor` (collective for a DTensor); keep a copy, cast on the device to
        `dtype`, when `keep`."""
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if keep:
            full = full.detach().to(dtype or full.dtype)
            host = torch.empty(full.shape, dtype=full.dtype, pin_memory=self.pin)
            host.copy_(full, non_blocking=self.pin and full.device.type == "cuda")
            self.tensors[name] = host

    def done(self) -> dict[str, torch.Tensor]:
        """The copies, once every one has arrived."""
        if self.pin:
            torch.cuda.synchronize(self.dist_info.device)
        return self.tensors
