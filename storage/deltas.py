"""Policy deltas: the entries of a model's weights that changed since the version before, exactly.

From one RL step to the next few of the serving-dtype weights change: AdamW at lr 1e-6 moves an
fp32 master by about 1e-6, and its bf16 cast changes only where that crosses a rounding boundary
(1.5-4.2 % of the entries of a 0.44B model, measured on the H200). A delta stores those entries.

- **Exact.** Entries are compared and stored as raw bit patterns (int16 for bf16 and fp16, int32
  for fp32), a value as the difference of the patterns modulo 2**bits, so base + delta is the new
  tensor bit for bit (NaN payloads and -0.0 included): no float arithmetic anywhere.
- **Cheap on the GPU.** A trainer rank lays the rows it owns of every tensor end to end in one
  flat *stream* (in the serving dtype) and compares it with the previous version's stream: one
  compare, one `nonzero`, a gather and two byte shuffles for the whole model, and only the
  changed entries cross to the host, in one copy.
- **Compact.** Positions (in the stream) are stored as gaps (the distance from the previous
  change, minus one), values as zigzag-coded signed differences (a one-ulp change is 1 or 2).
  Each array is byte-shuffled (every value's first byte, then every second byte, ...) and
  compressed with zstd: gaps of sparse changes compress to about their entropy (6 bits at 4 %
  density) and one-ulp values to 2.5 bits, about 1.1 bytes a changed entry in all.
- **Quick to write and read.** Each array is compressed in frames of `FRAME_BYTES`, on threads,
  and decompressed the same way. A delta is on the RL loop's critical path (the trainer writes
  it, then the servers load it, before the next batch is sampled), and where a third of the
  entries change (a 76M model at lr 1e-4) one frame took 0.25 s to compress and 0.33 s to
  decompress on one core. Concatenated zstd frames decode as one, so a reader that ignores the
  frame sizes still reads the file.

A delta file is safetensors holding `gaps` and `values` (uint8, compressed) and, in its
metadata, the format, the codec, the number of entries and the stream's `parts` in order: each
tensor's name, shape, dtype, the flat index in the whole tensor where the part starts
(`offset`) and its number of entries (`size`). A trainer rank writes its own file, and a reader
applies every file of a version in any order.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
import sys
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache

import numpy as np
import pyarrow as pa
import torch

from storage.tensor_files import Pieces, safetensors_pieces

FORMAT = "primeflow-delta/1"
CODEC = "zstd"
#: zstd level 1: on shuffled gaps and values levels 3 and 6 save under 1 % and run 1.3-5x slower.
_LEVEL = 1
_GAP_BYTES = 4
#: Raw bytes per zstd frame: large enough that a frame's overhead is nothing (a few bytes), small
#: enough that a 76M model's dense delta (144 MB raw) spreads over every thread.
FRAME_BYTES = 4 << 20
#: Threads that compress and decompress frames (zstd releases the GIL).
_FRAME_THREADS = min(8, os.cpu_count() or 1)
_NO_BYTES = torch.empty(0, dtype=torch.uint8)
_BITS: dict[torch.dtype, torch.dtype] = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
}


def _int_view(dtype: torch.dtype) -> torch.dtype:
    if dtype not in _BITS:
        raise ValueError(f"deltas support {sorted(map(str, _BITS))}, not {dtype}")
    return _BITS[dtype]


def changed_entries(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where `new` differs from `old` bit-wise, and by how much; on their device.

    old, new: (n,) streams of one dtype. Returns positions (k,) int64, ascending, and zigzag
    (k,) int64 in [0, 2**bits): the signed difference of the bit patterns, modulo 2**bits,
    zigzag-coded (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...).
    """
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(f"old {old.dtype}{list(old.shape)} vs new {new.dtype}{list(new.shape)}")
    view = _int_view(new.dtype)
    a, b = old.reshape(-1).view(view), new.reshape(-1).view(view)
    positions = torch.nonzero(a != b).squeeze(1)
    half = 1 << (8 * new.element_size() - 1)
    signed = torch.remainder(b[positions].long() - a[positions].long() + half, 2 * half) - half
    zigzag = torch.where(signed >= 0, 2 * signed, -2 * signed - 1)
    return positions, zigzag


def _shuffle(values: torch.Tensor, width: int) -> torch.Tensor:
    """(k,) int64 -> (width * k,) uint8: every value's byte 0, then every byte 1, ..."""
    return values.view(torch.uint8).reshape(-1, 8)[:, :width].t().reshape(-1)


def _unshuffle(data: torch.Tensor, width: int) -> torch.Tensor:
    """The inverse of `_shuffle`, on `data`'s device: (width * k,) uint8 -> (k,) int64."""
    planes = data.reshape(width, -1)
    out = planes.new_zeros((planes.shape[1], 8))
    out[:, :width] = planes.t()
    return out.view(torch.int64).reshape(-1)


def pack_entries(
    positions: torch.Tensor, zigzag: torch.Tensor, itemsize: int
) -> torch.Tensor | None:
    """The bytes to compress, on the device: shuffled gaps (4 bytes each), shuffled values.

    positions, zigzag: (k,) int64 from `changed_entries`; returns (k * (4 + itemsize),) uint8,
    or None when a gap does not fit 4 bytes (2**32 unchanged entries in a row: write a full
    version instead).
    """
    if sys.byteorder != "little":
        raise RuntimeError("delta encoding assumes a little-endian machine")
    gaps = torch.diff(positions, prepend=positions.new_full((1,), -1)) - 1
    if gaps.numel() and int(gaps.max()) >= 2 ** (8 * _GAP_BYTES):
        return None
    return torch.cat([_shuffle(gaps, _GAP_BYTES), _shuffle(zigzag, itemsize)])


@dataclass(frozen=True)
class Part:
    """One tensor's rows in a stream: entries `offset` .. `offset + size` of the whole tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    size: int


@dataclass(frozen=True)
class Delta:
    """A stream's changed entries, compressed: what one delta file holds."""

    parts: tuple[Part, ...]
    count: int
    gaps: bytes
    values: bytes
    #: Compressed size of each zstd frame of `gaps` and of `values`; every frame but the last
    #: holds `frame_bytes` raw bytes. Empty: one frame (and files written before frames).
    gaps_frames: tuple[int, ...] = ()
    values_frames: tuple[int, ...] = ()
    frame_bytes: int = 0

    @property
    def compressed_bytes(self) -> int:
        """What the delta's entries take compressed (the file adds a small header)."""
        return len(self.gaps) + len(self.values)


@cache
def _threads() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_FRAME_THREADS, thread_name_prefix="delta-frames")


def _compress(data: np.ndarray, frame_bytes: int) -> tuple[bytes, tuple[int, ...]]:
    """`data` as zstd frames of `frame_bytes` raw bytes each, compressed on threads; the
    frames' compressed sizes."""
    codec = pa.Codec(CODEC, compression_level=_LEVEL)
    frames = [data[i : i + frame_bytes] for i in range(0, len(data), frame_bytes)] or [data]
    blobs = list(_threads().map(lambda frame: codec.compress(frame, asbytes=True), frames))
    return b"".join(blobs), tuple(len(blob) for blob in blobs)


def _decompress(data: bytes, frames: Sequence[int], frame_bytes: int, out: np.ndarray) -> None:
    """Decompress `data` into `out` (its raw bytes), its frames (compressed sizes `frames`,
    each but the last `frame_bytes` raw) on threads; one frame when `frames` has at most one."""
    codec = pa.Codec(CODEC)
    size = len(out)
    if len(frames) <= 1:
        out[:] = np.frombuffer(codec.decompress(data, size, asbytes=False), dtype=np.uint8)
        return
    if sum(frames) != len(data) or not 0 < size - frame_bytes * (len(frames) - 1) <= frame_bytes:
        raise ValueError(f"frames {list(frames)} of {frame_bytes} bytes do not fit the data")
    starts = [0, *itertools.accumulate(frames)]

    def one(index: int) -> None:
        raw = min(frame_bytes, size - index * frame_bytes)
        frame = data[starts[index] : starts[index + 1]]
        decoded = codec.decompress(frame, raw, asbytes=False)
        out[index * frame_bytes : index * frame_bytes + raw] = np.frombuffer(decoded, np.uint8)

    list(_threads().map(one, range(len(frames))))


def compress_entries(
    parts: Iterable[Part], packed: np.ndarray, count: int, frame_bytes: int = FRAME_BYTES
) -> Delta:
    """Compress `pack_entries`' bytes (on the host) into a `Delta` over `parts`, each array
    in frames of `frame_bytes`."""
    split = count * _GAP_BYTES
    gaps, gaps_frames = _compress(packed[:split], frame_bytes)
    values, values_frames = _compress(packed[split:], frame_bytes)
    return Delta(tuple(parts), count, gaps, values, gaps_frames, values_frames, frame_bytes)


def packed_between(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]
) -> tuple[tuple[Part, ...], np.ndarray, int]:
    """What `compress_entries` takes for the delta from whole tensors `old` to `new` (one
    dtype), wherever they lie: the parts, the packed bytes on the host and the entries changed."""
    parts = tuple(
        Part(name, tuple(tensor.shape), tensor.dtype, 0, tensor.numel())
        for name, tensor in new.items()
    )
    stream_old = torch.cat([old[part.name].reshape(-1) for part in parts])
    positions, zigzag = changed_entries(
        stream_old, torch.cat([t.reshape(-1) for t in new.values()])
    )
    packed = pack_entries(positions, zigzag, stream_old.element_size())
    if packed is None:
        raise ValueError("a run of 2**32 unchanged entries is too long for a delta")
    return parts, packed.cpu().numpy(), positions.numel()


def delta_between(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> Delta:
    """The delta from whole tensors `old` to `new` (one dtype), wherever they lie."""
    return compress_entries(*packed_between(old, new))


def encode_delta_file(delta: Delta) -> Pieces:
    """A delta file's pieces (`storage.tensor_files`), compressed bytes not copied again."""
    names = [part.name for part in delta.parts]
    if len(set(names)) != len(names):
        raise ValueError("a tensor appears twice in one delta stream")
    described = [
        {
            "name": part.name,
            "shape": list(part.shape),
            "dtype": str(part.dtype).removeprefix("torch."),
            "offset": part.offset,
            "size": part.size,
        }
        for part in delta.parts
    ]
    tensors = {
        key: torch.frombuffer(bytearray(data), dtype=torch.uint8)
        for key, data in (("gaps", delta.gaps), ("values", delta.values))
    }
    metadata = {
        "format": FORMAT,
        "codec": CODEC,
        "count": str(delta.count),
        "parts": json.dumps(described),
    }
    if delta.frame_bytes:
        metadata["frames"] = json.dumps(
            {"bytes": delta.frame_bytes, "gaps": delta.gaps_frames, "values": delta.values_frames}
        )
    return safetensors_pieces(tensors, metadata)


def read_delta_file(data: bytes, what: str) -> Delta:
    """Parse a delta file; `ValueError` naming `what` when it is not one."""
    try:
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length])
        metadata = header.pop("__metadata__")
        if metadata.get("format") != FORMAT or metadata.get("codec") != CODEC:
            raise ValueError(f"format {metadata.get('format')!r}, codec {metadata.get('codec')!r}")
        body = memoryview(data)[8 + length :]

        def blob(key: str) -> bytes:
            start, end = header[key]["data_offsets"]
            if not 0 <= start <= end <= len(body):
                raise ValueError(f"{key} lies outside the file")
            return bytes(body[start:end])

        parts = tuple(
            Part(
                name=str(entry["name"]),
                shape=tuple(int(size) for size in entry["shape"]),
                dtype=getattr(torch, entry["dtype"]),
                offset=int(entry["offset"]),
                size=int(entry["size"]),
            )
            for entry in json.loads(metadata["parts"])
        )
        frames = json.loads(metadata.get("frames", '{"bytes": 0, "gaps": [], "values": []}'))
        return Delta(
            parts,
            int(metadata["count"]),
            blob("gaps"),
            blob("values"),
            tuple(int(size) for size in frames["gaps"]),
            tuple(int(size) for size in frames["values"]),
            int(frames["bytes"]),
        )
    except (ValueError, KeyError, TypeError, AttributeError, struct.error) as exc:
        raise ValueError(f"{what} is not a {FORMAT} file: {exc}") from exc


@dataclass(frozen=True)
class Unpacked:
    """A delta's entries decompressed on the host, still shuffled: what is left of decoding
    runs where they will be applied. A server unpacks deltas before it pauses (the host's
    share of a reload) so that its pause only copies and applies them."""

    parts: tuple[Part, ...]
    count: int
    itemsize: int
    #: (count * 4,) and (count * itemsize,) uint8: the shuffled gaps and zigzag values.
    gaps: torch.Tensor
    values: torch.Tensor


def unpack_delta(delta: Delta, pin: bool = False) -> Unpacked:
    """Decompress `delta`'s arrays on the host, into page-locked memory when `pin` (a copy
    to a GPU from it is quicker, and needs no staging copy)."""
    dtypes = {part.dtype for part in delta.parts}
    if len(dtypes) > 1:
        raise ValueError(f"a delta stream holds one dtype, not {sorted(map(str, dtypes))}")
    itemsize = torch.empty((), dtype=dtypes.pop()).element_size() if dtypes else 1

    def planes(data: bytes, width: int, frames: tuple[int, ...]) -> torch.Tensor:
        size = delta.count * width
        if not size:
            return _NO_BYTES
        out = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        _decompress(data, frames, delta.frame_bytes, out.numpy())
        return out

    return Unpacked(
        delta.parts,
        delta.count,
        itemsize,
        planes(delta.gaps, _GAP_BYTES, delta.gaps_frames),
        planes(delta.values, itemsize, delta.values_frames),
    )


def decode_unpacked(
    unpacked: Unpacked, device: torch.device | str = "cpu"
) -> list[tuple[Part, torch.Tensor, torch.Tensor]]:
    """Per part with changes: (part, positions in the whole tensor, signed differences), (k,)
    int64 each, on `device`.

    The unshuffle, the running sum of the gaps and the zigzag decoding run where the entries
    will be applied: on a GPU they take milliseconds where the host took most of a swap (0.76
    s a step for a 76M model on an H100, docs/benchmarks.md).
    """
    if not unpacked.parts:
        return []
    on_device = torch.device(device)
    pinned = on_device.type == "cuda" and unpacked.gaps.is_pinned()
    gaps = unpacked.gaps.to(on_device, non_blocking=pinned)
    positions = torch.cumsum(_unshuffle(gaps, _GAP_BYTES) + 1, 0) - 1
    zigzag = _unshuffle(unpacked.values.to(on_device, non_blocking=pinned), unpacked.itemsize)
    signed = (zigzag >> 1) ^ -(zigzag & 1)
    sizes = [part.size for part in unpacked.parts]
    starts = [0, *itertools.accumulate(sizes)]
    if unpacked.count and int(positions[-1]) >= starts[-1]:
        raise ValueError(f"a position lies past the stream's {starts[-1]} entries")
    bounds = torch.searchsorted(positions, positions.new_tensor(starts)).tolist()
    decoded = []
    for index, part in enumerate(unpacked.parts):
        if part.offset + part.size > math.prod(part.shape):
            raise ValueError(f"{part.name}: part past the tensor's {list(part.shape)}")
        low, high = bounds[index], bounds[index + 1]
        if high > low:
            local = positions[low:high] - (starts[index] - part.offset)
            decoded.append((part, local, signed[low:high]))
    return decoded


def decode_delta(
    delta: Delta, device: torch.device | str = "cpu"
) -> list[tuple[Part, torch.Tensor, torch.Tensor]]:
    """`decode_unpacked` of the delta unpacked on the host."""
    return decode_unpacked(unpack_delta(delta), device)


def apply_entries(
    target: torch.Tensor, positions: torch.Tensor, signed: torch.Tensor, offset: int = 0
) -> None:
    """Add `signed` to the bit patterns of contiguous `target` at flat `positions` + `offset`,
    modulo 2**bits: the one way a delta changes values, on any device.

    positions, signed: (k,) int64 from `decode_delta`, best on `target`'s device.
    """
    if not target.is_contiguous():
        raise ValueError("a delta is applied to contiguous tensors only")
    flat = target.view(-1).view(_int_view(target.dtype))
    index = positions.to(flat.device) + offset
    # `signed` lies in the int dtype's range, and integer addition in it wraps around: modulo
    # 2**bits, as the values were taken.
    flat[index] += signed.to(flat.device, flat.dtype)


def check_fits(part: Part, target: torch.Tensor | None) -> None:
    """Raise unless `target` is the tensor `part` was encoded for (name, shape, dtype)."""
    if target is None:
        raise ValueError(f"the delta changes {part.name}, which the base does not have")
    if tuple(target.shape) != part.shape or target.dtype != part.dtype:
        raise ValueError(
            f"{part.name}: delta for {part.dtype}{list(part.shape)}, "
            f"base holds {target.dtype}{list(target.shape)}"
        )


def apply_delta(tensors: Mapping[str, torch.Tensor], delta: Delta) -> int:
    """Apply `delta` in place to contiguous `tensors`; returns the entries changed.

    Every part is checked against its tensor before any is changed.
    """
    decoded = decode_delta(delta)
    for part, _, _ in decoded:
        check_fits(part, tensors.get(part.name))
    for part, positions, signed in decoded:
        apply_entries(tensors[part.name], positions, signed)
    return delta.count
