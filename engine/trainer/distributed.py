"""The trainer's process group: torchrun's environment, or one process on its own.

torchrun (and its multi-node rendezvous) sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT; nothing here replaces it. A process started without torchrun forms a group of one,
so FSDP2 and every collective run unchanged in tests and single-device runs.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

T = TypeVar("T")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the group and which device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    mesh: DeviceMesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_backend(backend: Literal["auto", "gloo", "nccl"]) -> str:
    """`auto` is NCCL when CUDA is available and gloo otherwise."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("trainer.parallel.backend = 'nccl' needs CUDA, and none is available")
    return backend


def init_distributed(backend: Literal["auto", "gloo", "nccl"] = "auto") -> DistInfo:
    """Join (or, without torchrun, create) the process group and pick this rank's device."""
    name = resolve_backend(backend)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if name == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        device_id = device if name == "nccl" else None
        if "RANK" in os.environ:
            dist.init_process_group(name, device_id=device_id)
        else:
            # A group of one needs no rendezvous: an in-memory store, no port to collide on.
            dist.init_process_group(
                name,
                # torch.distributed imports HashStore without marking it as exported.
                store=dist.HashStore(),  # type: ignore[attr-defined]
                rank=0,
                world_size=1,
                device_id=device_id,
            )
    world_size = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world_size,))
    return DistInfo(
        rank=dist.get_rank(),
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        backend=name,
        mesh=mesh,
    )


def close_distributed() -> None:
    """Leave the process group (a no-op when none was joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Sum scalar values over all ranks in one collective (keys must match on every rank)."""
    if not values:
        return {}
    names = sorted(values)
    tensor = torch.tensor([float(values[n]) for n in names], dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return dict(zip(names, tensor.tolist(), strict=True))


def all_reduce_max(value: float, device: torch.device) -> float:
    """The largest `value` over all ranks (e.g. peak memory)."""
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def agree_sums(values: list[int], dist_info: DistInfo) -> list[int]:
    """Sum integer `values` over the ranks (one small all-reduce), so every rank decides alike."""
    if not dist.is_initialized() or dist_info.world_size == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.int64, device=dist_info.device)
    dist.all_reduce(tensor)
    return [int(value) for value in tensor.tolist()]


def from_main(value: T, dist_info: DistInfo) -> T:
    """Rank 0's `value` on every rank (collective; other ranks' `value` is ignored): a
    decision rank 0 takes alone, from what only it reads, that every rank then acts on."""
    if not dist.is_initialized() or dist_info.world_size == 1:
        return value
    box: list[Any] = [value if dist_info.is_main else None]
    dist.broadcast_object_list(box, src=0, device=dist_info.device)
    return cast(T, box[0])  # rank 0's value, a T


def shared_uid(dist_info: DistInfo) -> str:
    """A random id drawn by rank 0 and known to every rank (collective): names one write of a
    step that several ranks take part in."""
    bits = [secrets.randbits(62), secrets.randbits(62)] if dist_info.is_main else [0, 0]
    high, low = agree_sums(bits, dist_info)
    return f"{high:016x}{low:016x}"
