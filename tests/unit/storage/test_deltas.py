"""Policy deltas: exact for every bit pattern, compact for one-ulp changes, refused when wrong."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from storage.deltas import (
    Part,
    apply_delta,
    apply_entries,
    changed_entries,
    compress_entries,
    decode_delta,
    delta_between,
    encode_delta_file,
    pack_entries,
    read_delta_file,
)

INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def file_bytes(delta) -> bytes:
    return b"".join(bytes(piece) for piece in encode_delta_file(delta))


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(INT_VIEW[tensor.dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_base_plus_delta_is_the_new_tensor_bit_for_bit(dtype: torch.dtype) -> None:
    check_base_plus_delta(dtype, "cpu")


def check_base_plus_delta(dtype: torch.dtype, device: str) -> None:
    """Base + delta is the new tensor bit for bit, the tensors and the decoding on `device`."""
    generator = torch.Generator().manual_seed(0)
    masters = torch.randn(300, 70, generator=generator) * 0.02
    old = {"w": masters.to(dtype), "b": torch.zeros(70, dtype=dtype)}
    new = {
        "w": (masters + 1e-4 * torch.randn(masters.shape, generator=generator)).to(dtype),
        "b": torch.zeros(70, dtype=dtype),  # unchanged: no entries, still a part
    }
    # The patterns float arithmetic would get wrong: NaN payloads, signed zeros, infinities,
    # and the largest jumps (the most negative to the most positive pattern and back).
    info = torch.finfo(dtype)
    old["w"].view(-1)[:6] = torch.tensor([0.0, -0.0, 1.0, info.min, info.max, float("inf")])
    new["w"].view(-1)[:6] = torch.tensor([-0.0, 0.0, float("nan"), info.max, info.min, -1e30])
    old, new = ({k: t.to(device) for k, t in d.items()} for d in (old, new))
    delta = read_delta_file(file_bytes(delta_between(old, new)), "test")
    rebuilt = {name: tensor.clone() for name, tensor in old.items()}
    assert apply_delta(rebuilt, delta) == int((bits(old["w"]) != bits(new["w"])).sum())
    for name in new:
        assert torch.equal(bits(rebuilt[name]), bits(new[name])), name
    decoded = decode_delta(delta, device)
    assert [part.name for part, _, _ in decoded] == ["w"]
    (_, positions, signed), *_ = decoded
    assert positions.device == signed.device == old["w"].device
    rebuilt = {name: tensor.clone() for name, tensor in old.items()}
    apply_entries(rebuilt["w"], positions, signed)
    assert torch.equal(bits(rebuilt["w"]), bits(new["w"]))


def test_ranks_streams_of_one_tensor_apply_in_any_order() -> None:
    """Each trainer rank encodes the rows it owns, with their flat offset in the whole tensor."""
    generator = torch.Generator().manual_seed(1)
    old = torch.randn(10, 64, generator=generator).bfloat16()
    new = (old.float() + 0.05 * torch.randn(10, 64, generator=generator)).bfloat16()
    files = []
    for start, end in ((8, 10), (0, 4), (4, 8)):
        rows = slice(start, end)
        positions, zigzag = changed_entries(old[rows].reshape(-1), new[rows].reshape(-1))
        packed = pack_entries(positions, zigzag, 2)
        part = Part("w", (10, 64), torch.bfloat16, start * 64, (end - start) * 64)
        files.append(file_bytes(compress_entries([part], packed.numpy(), positions.numel())))
    rebuilt = old.clone()
    for data in files:
        apply_delta({"w": rebuilt}, read_delta_file(data, "part"))
    assert torch.equal(bits(rebuilt), bits(new))


def test_one_ulp_changes_cost_about_a_byte_each() -> None:
    """The case deltas exist for: AdamW at a small lr flips a few percent of bf16 entries by
    one unit in the last place."""
    generator = torch.Generator().manual_seed(2)
    masters = torch.randn(2_000_000, generator=generator) * 0.02
    old = masters.bfloat16()
    new = (masters + 1e-6 * torch.randn(masters.shape, generator=generator).sign()).bfloat16()
    delta = delta_between({"w": old}, {"w": new})
    assert 0.01 < delta.count / old.numel() < 0.1
    encoded = len(file_bytes(delta))
    assert encoded / delta.count < 1.3  # 6 bytes an entry before compression
    assert encoded < old.numel() * 2 / 10


def test_a_delta_for_another_tensor_is_refused() -> None:
    old = torch.zeros(4, 4, dtype=torch.bfloat16)
    delta = delta_between({"w": old}, {"w": torch.ones(4, 4, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="does not have"):
        apply_delta({"v": old.clone()}, delta)
    with pytest.raises(ValueError, match="base holds"):
        apply_delta({"w": torch.zeros(2, 8, dtype=torch.bfloat16)}, delta)
    with pytest.raises(ValueError, match="not a primeflow-delta/1 file"):
        read_delta_file(b"\x10\x00\x00\x00\x00\x00\x00\x00{}" + b" " * 14, "junk.safetensors")
    with pytest.raises(ValueError, match="deltas support"):
        changed_entries(torch.zeros(3, dtype=torch.int64), torch.ones(3, dtype=torch.int64))
    assert torch.equal(old, torch.zeros(4, 4, dtype=torch.bfloat16))  # nothing half-applied


def test_a_delta_of_many_frames_reads_as_one_of_one_frame() -> None:
    """Frames are compressed and decompressed on threads; concatenated they decode as one,
    so a reader that ignores their sizes reads the file too."""
    generator = torch.Generator().manual_seed(2)
    old = torch.randn(64, 64, generator=generator).bfloat16()
    new = (old.float() + 0.05 * torch.randn(64, 64, generator=generator)).bfloat16()
    positions, zigzag = changed_entries(old.reshape(-1), new.reshape(-1))
    packed = pack_entries(positions, zigzag, 2).numpy()
    part = Part("w", (64, 64), torch.bfloat16, 0, 64 * 64)
    framed = read_delta_file(
        file_bytes(compress_entries([part], packed, positions.numel(), frame_bytes=1000)), "f"
    )
    assert len(framed.gaps_frames) == math.ceil(positions.numel() * 4 / 1000) > 4
    single = compress_entries([part], packed, positions.numel(), frame_bytes=len(packed))
    assert len(single.gaps_frames) == len(single.values_frames) == 1
    unframed = dataclasses.replace(framed, gaps_frames=(), values_frames=(), frame_bytes=0)
    for delta in (framed, single, unframed):
        rebuilt = old.clone()
        apply_delta({"w": rebuilt}, delta)
        assert torch.equal(bits(rebuilt), bits(new))
    broken = dataclasses.replace(framed, gaps_frames=framed.gaps_frames[:-1])
    with pytest.raises(ValueError, match="do not fit the data"):
        decode_delta(broken)
