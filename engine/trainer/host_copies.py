"""Full tensors gathered one at a time and copied to the host of the rank that keeps them,
while the next training step runs.

A resume checkpoint and a full policy version are both snapshotted this way after the
optimizer step: each parameter (or optimizer moment) is gathered on the device on its own (a
collective for a DTensor, so every rank takes part), so no rank ever holds a second copy of the
model on the device; only the rank that writes it keeps a host copy, in pinned memory on CUDA.

On CUDA the gathers, casts and copies are queued on a side stream that first waits for the
work already queued (the optimizer step), and the host does not wait for them: the next step's
forward and backward run while the copies cross PCIe (a 0.6B model's fp32 state, 7 GB, takes
~0.17 s at PCIe's rate, 10 % of a 64k-token step, when training waits for it). Nothing changes
what is copied until the next optimizer step, so that step waits on the device for the copies
(`Fence.guard`), and the writer thread waits for them before it reads the host memory
(`Fence.wait`).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from engine.trainer.distributed import DistInfo


class Fence:
    """The moment a snapshot's copies are complete (always, off CUDA)."""

    def __init__(self, event: torch.cuda.Event | None) -> None:
        self._event = event

    def wait(self) -> None:
        """Block this thread until the copies are in host memory."""
        if self._event is not None:
            self._event.synchronize()

    def guard(self, optimizer: Optimizer) -> None:
        """Make `optimizer`'s next step wait on the device until the copies are taken, since it
        changes the parameters and moments in place. Nothing waits on the host."""
        if self._event is not None:
            _fences_before_step(optimizer).append(self._event)


#: The fences each optimizer's next step waits for (a policy version's and a checkpoint's
#: may both be pending).
_PENDING: weakref.WeakKeyDictionary[Optimizer, list[torch.cuda.Event]] = weakref.WeakKeyDictionary()


def _fences_before_step(optimizer: Optimizer) -> list[torch.cuda.Event]:
    """The list of fences `optimizer`'s next step waits on, with the one pre-step hook that
    waits on them and empties it (a hook that removed itself would change the hooks while the
    optimizer iterates over them, and fail when two fences are pending)."""
    pending = _PENDING.get(optimizer)
    if pending is None:
        pending = _PENDING[optimizer] = []

        def before_step(*_: object) -> None:
            stream = torch.cuda.current_stream()
            for event in pending:
                stream.wait_event(event)
            pending.clear()

        optimizer.register_step_pre_hook(before_step)
    return pending


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the device: gathered from its shards (collective) when it has any.

    On a one-rank mesh the local shard is the whole tensor; `full_tensor` would still plan and
    run a gather, ~0.3 ms of host time a tensor, 0.2 s for a 0.6B model's weights and moments.
    """
    if not isinstance(tensor, DTensor):
        return tensor
    if tensor.device_mesh.size() == 1:
        return tensor.to_local()
    return tensor.full_tensor()


class HostCopies:
    """The host copies this rank keeps of the tensors passed to `add`."""

    def __init__(self, dist_info: DistInfo) -> None:
        self.dist_info = dist_info
        self.pin = dist_info.device.type == "cuda"
        self.tensors: dict[str, torch.Tensor] = {}
        #: Bytes of every tensor added, kept here or not (the indexes list them all).
        self.sizes: dict[str, int] = {}
        self._stream: torch.cuda.Stream | None = None
        if self.pin:
            self._stream = torch.cuda.Stream(dist_info.device)
            self._stream.wait_stream(torch.cuda.current_stream(dist_info.device))

    @contextlib.contextmanager
    def _on_side_stream(self) -> Iterator[None]:
        if self._stream is None:
            yield
        else:
            with torch.cuda.stream(self._stream):
                yield

    def add(
        self, name: str, tensor: torch.Tensor, *, keep: bool, dtype: torch.dtype | None = None
    ) -> None:
        """Gather `tensor` (collective for a DTensor); keep a copy, cast on the device to
        `dtype`, when `keep`."""
        with self._on_side_stream():
            full = _whole(tensor)
            self.sizes[name] = full.numel() * (dtype or full.dtype).itemsize
            if keep:
                full = full.detach().to(dtype or full.dtype)
                host = torch.empty(full.shape, dtype=full.dtype, pin_memory=self.pin)
                host.copy_(full, non_blocking=self.pin and full.device.type == "cuda")
                self.tensors[name] = host

    def done(self) -> tuple[dict[str, torch.Tensor], Fence]:
        """The copies (still arriving on CUDA) and the fence that says when they have."""
        if self._stream is None:
            return self.tensors, Fence(None)
        event = torch.cuda.Event()
        event.record(self._stream)
        return self.tensors, Fence(event)


def warm_pinned_memory(sizes: Iterable[int]) -> threading.Thread:
    """Allocate and free pinned blocks of `sizes` bytes on a thread, so a later snapshot finds
    them in torch's pinned-memory cache: pinning 7 GB for the first time costs ~2 s, which
    would otherwise stall the step of the first checkpoint."""

    def allocate() -> None:
        blocks = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for size in sizes]
        del blocks

    thread = threading.Thread(target=allocate, name="warm-pinned-memory", daemon=True)
    thread.start()
    return thread
