"""Policy versions and checkpoints as local folders, read without a model: their weight files,
names and shapes, commit meta, delta entries, and the weights a chain of versions rebuilds.

Both the pool (to check a folder before any server is touched) and the vLLM worker extension
(`engine.inference.reload_ext`, inside vLLM's worker processes) read folders through this
module, so it obeys the extension's rule: it imports primeflow's storage formats
(`storage.deltas`, `storage.commit`'s marker, `storage.layout`'s file names) and nothing else
of primeflow's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from storage.commit import MARKER
from storage.layout import is_delta_file

# Tensors (torch, `storage.deltas`) load where versions are applied, in vLLM's worker: the pool,
# which only checks folders' names and shapes, never imports torch for it.
if TYPE_CHECKING:
    import torch

    from storage.deltas import Part, Unpacked

#: A version's changed entries, decoded: (part, positions in the whole tensor, differences).
Decoded = list[tuple["Part", "torch.Tensor", "torch.Tensor"]]

#: Tensor name → shape over a folder's weight files.
Signature = dict[str, tuple[int, ...]]

_INDEX = "model.safetensors.index.json"
#: The output layer a tied model may or may not store (it is the embedding either way).
TIED_HEAD = "lm_head.weight"


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a HF model folder (those its index names, if it has one)."""
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    index = folder / _INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / name for name in names]
    else:
        files = sorted(f for f in folder.glob("*.safetensors") if not is_delta_file(f.name))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return files


def read_signature(folder: Path) -> Signature:
    """Tensor name → shape over all weight files; raises if any file is missing or truncated."""
    signature: Signature = {}
    for file in weight_files(folder):
        try:  # shapes come from the header: numpy's reader needs no torch, bf16 files included
            with safe_open(str(file), framework="numpy") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    signature[name] = tuple(handle.get_slice(name).get_shape())
        except FileNotFoundError:
            raise
        except Exception as exc:  # safetensors raises its own error types for bad files
            raise ValueError(f"{file} is not a readable safetensors file: {exc}") from exc
    return signature


def signature_mismatch(expected: Signature, found: Signature, *, tied: bool) -> str | None:
    """Why `found` cannot replace `expected`, or None when it can.

    A tied head may be present in one and absent in the other: it is the embedding either way.
    """
    if tied:
        expected = {k: v for k, v in expected.items() if k != TIED_HEAD}
        found = {k: v for k, v in found.items() if k != TIED_HEAD}
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    reshaped = sorted(k for k in set(expected) & set(found) if expected[k] != found[k])
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensors (first: {missing[0]})")
    if extra:
        problems.append(f"{len(extra)} unexpected tensors (first: {extra[0]})")
    if reshaped:
        name = reshaped[0]
        problems.append(f"{name} has shape {list(found[name])}, expected {list(expected[name])}")
    return "; ".join(problems) or None


def iterate_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs, file by file, as vLLM's `load_weights` consumes them."""
    for file in weight_files(folder):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                yield name, handle.get_tensor(name)


def commit_meta(folder: Path) -> dict[str, object]:
    """The `meta` of the folder's `_COMMITTED` marker; empty for a bare model folder."""
    marker = folder / MARKER
    return dict(json.loads(marker.read_text()).get("meta") or {}) if marker.is_file() else {}


def is_delta(meta: dict[str, object]) -> bool:
    return meta.get("kind") == "delta"


def keeps_mirror(meta: dict[str, object]) -> bool:
    """Whether deltas will follow this full version, so its tensors are worth keeping."""
    return meta.get("uid") is not None and int(str(meta.get("full_every", 1))) > 1


#: Deltas of up to this many entries are decoded on the device they go to (16 bytes an entry
#: of positions and differences there, 0.5 GiB at most); larger ones on the host, so that a
#: big model's delta never needs GPU memory the server did not plan for.
DEVICE_DECODE_ENTRIES = 1 << 25


def unpack_delta_folder(folder: Path, pin: bool = False) -> list[Unpacked]:
    """A delta version's files (one per trainer rank) read and decompressed on the host, into
    page-locked memory when `pin`: the part of loading it that needs no device."""
    from storage.deltas import read_delta_file, unpack_delta

    files = sorted(f for f in folder.glob("*.safetensors") if is_delta_file(f.name))
    if not files:
        raise FileNotFoundError(f"delta version {folder} has no delta files")
    return [unpack_delta(read_delta_file(file.read_bytes(), str(file)), pin) for file in files]


def decode_unpacked_folder(unpacked: list[Unpacked], device: torch.device | str = "cpu") -> Decoded:
    """Every changed entry of an unpacked delta version, decoded on `device` (where they
    will be applied) unless a file is too large for it."""
    from storage.deltas import decode_unpacked

    decoded: Decoded = []
    for entries in unpacked:
        decoded += decode_unpacked(
            entries, device if entries.count <= DEVICE_DECODE_ENTRIES else "cpu"
        )
    return decoded


def read_delta_folder(folder: Path, device: torch.device | str = "cpu") -> Decoded:
    """`decode_unpacked_folder` of the folder unpacked on the host."""
    return decode_unpacked_folder(unpack_delta_folder(folder), device)


def rebuild(folders: list[Path]) -> dict[str, torch.Tensor]:
    """The weights of the last of `folders`: a full version, then the deltas that follow it."""
    from storage.deltas import apply_entries, check_fits

    if not folders or is_delta(commit_meta(folders[0])):
        raise ValueError("a chain of versions to rebuild starts with a full one")
    tensors = dict(iterate_weights(folders[0]))
    for folder in folders[1:]:
        decoded = read_delta_folder(folder)
        for part, _, _ in decoded:
            check_fits(part, tensors.get(part.name))
        for part, positions, signed in decoded:
            apply_entries(tensors[part.name], positions, signed)
    return tensors


def served_model_folder(model: str, revision: str | None) -> Path:
    """The local folder of the model the server started from (a path, or a hub snapshot)."""
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import snapshot_download

    # vLLM downloaded it at startup, so the cache has it: no network needed here.
    return Path(snapshot_download(model, revision=revision, local_files_only=True))
