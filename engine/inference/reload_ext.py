"""vLLM worker extension: reload a checkpoint folder in place, safely, with tied heads re-packed.

Loaded by every vLLM worker through `--worker-extension-cls`, and called over the server's
`/collective_rpc` route. It exists for five reasons vLLM's own `reload_weights` does not cover:

1. **Validation before mutation.** vLLM moves each layer to the meta device before it reads the
   new tensors, so a checkpoint that is missing, truncated or shaped for another model would
   leave the server half-loaded. Here every file's safetensors header is read (which also checks
   that the file is as long as the header says) and the names and shapes are compared with the
   weights the server started from before a single parameter is touched.
2. **Tied output layers on CPU.** vLLM's CPU backend packs each linear layer's weight into a
   oneDNN/AMX layout once. A tied `lm_head` shares its weight with `embed_tokens` and is never
   loaded itself, so after a reload it kept computing logits from the *old* packed copy. The
   shared weight is re-packed after every reload.
3. **No drift of the served model.** Weights are passed as an iterator rather than a path, so the
   worker's `model_config.model` keeps naming what the server was started with.
4. **Proof of what is served, on every vLLM.** Each worker records the policy version it loaded
   and reports it back (vLLM 0.26 has no `/update_weight_version` or `/weight_info` routes), and
   `primeflow_compare` checks the served parameters against a checkpoint folder bit for bit.
5. **Delta versions.** A policy version may be a delta against the one before
   (`storage.deltas`). After a full policy version that deltas follow, a worker applies each
   delta exactly, in place on the served parameters where every checkpoint tensor is a plain
   block of rows of one of them (a GPU server without tensor parallelism: milliseconds, no
   reload), or else to a host copy of the weights (its *mirror*, e.g. on vLLM's CPU backend,
   whose linear layers are packed away) that it then loads. A delta is applied only onto the
   version it was encoded against (by uid), never onto another lineage's version of that step.

This module runs inside vLLM's worker processes: it may import vLLM, primeflow's storage
formats (`storage.deltas`: torch, numpy and pyarrow; `storage.commit`'s marker) and the folder
readers of `engine.inference.weight_folders`, which keep the same rule; nothing else of
primeflow's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import NamedTuple

import torch

from engine.inference.weight_folders import (
    Decoded,
    Signature,
    commit_meta,
    decode_unpacked_folder,
    is_delta,
    iterate_weights,
    keeps_mirror,
    read_signature,
    rebuild,
    served_model_folder,
    signature_mismatch,
    unpack_delta_folder,
)
from storage.deltas import Unpacked, apply_entries, check_fits
from storage.tensor_files import ties_word_embeddings


class Target(NamedTuple):
    """Where a checkpoint tensor of `shape` lies: `param`, from its flat entry `offset` on."""

    param: torch.Tensor
    offset: int
    shape: tuple[int, ...]


def inplace_targets(
    params: Iterator[tuple[str, torch.Tensor]],
    shapes: Signature,
    dtype: torch.dtype,
    packed: dict[str, list[str]],
) -> dict[str, Target] | None:
    """Where each checkpoint tensor lies in the served parameters, if every one is a plain
    block of rows of one (stacked as `checkpoint_names` says, padded rows after it) in `dtype`;
    None when any is not: sharded, packed away, converted or strided."""
    targets: dict[str, Target] = {}
    for served, param in params:
        row = 0
        for name in checkpoint_names(served, packed):
            shape = shapes.get(name)
            if shape is None:
                continue
            if (
                param.numel() == 0
                or param.dtype != dtype
                or not param.is_contiguous()
                or tuple(param.shape[1:]) != shape[1:]
                or param.shape[0] < row + shape[0]
            ):
                return None
            targets[name] = Target(param, row * math.prod(shape[1:]), shape)
            row += shape[0]
    return targets if set(shapes) <= set(targets) else None


def repack_tied_heads(model: torch.nn.Module) -> int:
    """Re-run the CPU weight packing of every embedding-style layer whose weight is shared.

    A no-op off CPU, where these layers use `layer.weight` directly. Returns the number of
    layers re-packed.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter):
            owners.setdefault(id(weight), []).append(module)
    repacked = 0
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for module in modules:
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod):
                method.process_weights_after_loading(module)
                repacked += 1
    return repacked


def wrapped_for_lora(model: torch.nn.Module) -> set[str]:
    """The layers runtime LoRA wrapped whose weights this vLLM loads only under the wrapped
    layer's name (`<layer>.base_layer.<leaf>`): vLLM 0.26's LoRA layers have no `load_weights`
    of their own; later releases forward checkpoint names to the wrapped layer themselves."""
    return {
        name
        for name, module in model.named_modules()
        if isinstance(getattr(module, "base_layer", None), torch.nn.Module)
        and not callable(getattr(type(module), "load_weights", None))
    }


def under_wrapped_names(
    weights: Iterator[tuple[str, torch.Tensor]], wrapped: set[str], packed: dict[str, list[str]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors renamed `<layer>.base_layer.<leaf>` where their served layer (the
    fused one for a packed projection: `q_proj` is in `qkv_proj`) is one of `wrapped`."""
    fused = {sub: whole for whole, subs in packed.items() for sub in subs}
    for name, tensor in weights:
        layer, _, leaf = name.rpartition(".")
        parent, _, last = layer.rpartition(".")
        served = f"{parent}.{fused.get(last, last)}" if parent else fused.get(last, last)
        yield (f"{layer}.base_layer.{leaf}" if served in wrapped else name), tensor


def checkpoint_names(served: str, packed: dict[str, list[str]]) -> list[str]:
    """The checkpoint tensors a served parameter is made of, in the order vLLM stacks them.

    vLLM fuses some projections into one parameter (`qkv_proj` = q, k and v stacked along the
    output dimension; `gate_up_proj` = gate and up), as the model's `packed_modules_mapping`
    says; every other parameter keeps its checkpoint name. With runtime LoRA enabled, vLLM
    wraps each adapted layer and its weight is `<layer>.base_layer.weight`.
    """
    parts = served.replace(".base_layer.", ".").split(".")
    for index, part in enumerate(parts):
        if part in packed:
            return [".".join([*parts[:index], sub, *parts[index + 1 :]]) for sub in packed[part]]
    return [served]


def expected_served(
    served: str,
    shape: tuple[int, ...],
    tensors: dict[str, torch.Tensor],
    packed: dict[str, list[str]],
) -> torch.Tensor | None:
    """What parameter `served` of `shape` must hold after loading `tensors`; None if not there.

    Embedding-style parameters are padded by vLLM to a multiple of its vocabulary padding:
    the expected tensor is compared on the checkpoint's rows only (the caller slices).
    """
    names = checkpoint_names(served, packed)
    if not all(name in tensors for name in names):
        return None
    parts = [tensors[name] for name in names]
    whole = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    if whole.ndim != len(shape) or any(w > s for w, s in zip(whole.shape, shape, strict=True)):
        raise ValueError(f"{served}: checkpoint shape {list(whole.shape)} vs served {list(shape)}")
    return whole


def compare_served(
    params: Iterator[tuple[str, torch.Tensor]],
    tensors: dict[str, torch.Tensor],
    packed: dict[str, list[str]],
) -> dict[str, object]:
    """Compare each served parameter with the checkpoint, cast to the parameter's dtype.

    Returns counts: `compared` (equal or not), `mismatched` (names, first 8) and `max_abs_diff`,
    `packed_away` (parameters a backend replaced by a packed copy and emptied, e.g. vLLM's CPU
    linear layers: not comparable here) and `absent` (served parameters with no checkpoint
    tensor, e.g. a tied head under its embedding's name).
    """
    compared, packed_away, absent = 0, 0, 0
    mismatched: list[str] = []
    max_diff = 0.0
    for name, param in params:
        if param.numel() == 0:
            packed_away += 1
            continue
        expected = expected_served(name, tuple(param.shape), tensors, packed)
        if expected is None:
            absent += 1
            continue
        rows = tuple(slice(0, size) for size in expected.shape)
        served = param.detach()[rows]
        expected = expected.to(device=served.device, dtype=served.dtype)
        compared += 1
        if not torch.equal(served, expected):
            mismatched.append(name)
            diff = (served.float() - expected.float()).abs().max().item()
            max_diff = max(max_diff, diff)
    return {
        "compared": compared,
        "mismatched": len(mismatched),
        "mismatched_names": mismatched[:8],
        "max_abs_diff": max_diff,
        "packed_away": packed_away,
        "absent": absent,
    }


@cache
def _stager() -> ThreadPoolExecutor:
    """The thread that unpacks deltas beside generation (its zstd frames decompress on
    `storage.deltas`' threads, which release the GIL)."""
    return ThreadPoolExecutor(1, thread_name_prefix="primeflow-stage")


@cache
def _pin() -> bool:
    """Unpack into page-locked memory: on a GPU host its copy to the device is quicker."""
    return torch.cuda.is_available()


class WeightReloadExtension:
    """Methods mixed into vLLM's worker class; `self` is the worker (`model_runner`, configs)."""

    _primeflow_reference: Signature | None = None
    _primeflow_version: int = 0
    #: Where deltas go after a full policy version: the served parameters themselves, or a host
    #: copy of the weights; and the uid of the version they hold.
    _primeflow_targets: dict[str, Target] | None = None
    _primeflow_mirror: dict[str, torch.Tensor] | None = None
    _primeflow_held: str | None = None
    #: Delta folders unpacked, or being unpacked, ahead of their reload, by path.
    _primeflow_staged: dict[str, Future[list[Unpacked]]] | None = None

    def primeflow_version(self) -> dict[str, int]:
        """The policy version this worker serves (0 until the first reload)."""
        return {"version": self._primeflow_version}

    def primeflow_compare(self, *folders: str) -> dict[str, object]:
        """Compare the weights this worker serves with a version, bit for bit.

        `folders`: one checkpoint folder, or a full policy version and the deltas after it
        (rebuilt here from the files, independently of the worker's mirror).
        """
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        parallel = self.vllm_config.parallel_config  # type: ignore[attr-defined]
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size != 1:
            raise ValueError("the direct weight check needs one GPU per server (no TP or PP)")
        tensors = rebuild([Path(folder) for folder in folders])
        packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        report = compare_served(model.named_parameters(), tensors, packed)
        return {**report, "version": self._primeflow_version}

    def primeflow_stage(self, *folders: str) -> dict[str, object]:
        """Start unpacking the delta folders among `folders` on the host, beside generation;
        `ready` once all of them are.

        A reload pauses generation. A delta read and decompressed before the pause leaves it
        only the copy to the device and the application. The engine runs this call between
        its steps and it returns at once: call it again (it starts nothing twice) until
        `ready`. The next `primeflow_reload` takes what it needs and drops the rest.
        """
        if self._primeflow_staged is None:
            self._primeflow_staged = {}
        staged = self._primeflow_staged
        wanted = [str(Path(folder)) for folder in folders]
        for folder in wanted:
            if folder not in staged and is_delta(commit_meta(Path(folder))):
                staged[folder] = _stager().submit(unpack_delta_folder, Path(folder), _pin())
        return {"ready": all(staged[f].done() for f in wanted if f in staged)}

    def primeflow_reload(self, version: str, *folders: str) -> dict[str, object]:
        """Load a version in place, re-pack tied heads; `version` is recorded as served.

        `folders` is a chain: a full version (or checkpoint) and the delta versions after it,
        or only deltas onto the version this worker holds. Every full folder is checked and
        every delta read and decoded before a single served parameter is touched. Strings
        only: `/collective_rpc` passes nothing else. Returns the version and the uid of the
        version the next delta may be applied to (`holds`, None when none may).
        """
        paths = [Path(folder) for folder in folders]
        if not paths:
            raise ValueError("primeflow_reload needs at least one folder")
        metas = [commit_meta(path) for path in paths]
        staged, self._primeflow_staged = self._primeflow_staged or {}, None
        unpacked_ahead = 0
        decoded: dict[Path, Decoded] = {}
        signatures: dict[Path, Signature] = {}
        try:
            for path, meta in zip(paths, metas, strict=True):
                if is_delta(meta):
                    ahead = staged.pop(str(path), None)
                    unpacked_ahead += ahead is not None
                    unpacked = ahead.result() if ahead else unpack_delta_folder(path, _pin())
                    device = self._primeflow_delta_device()
                    decoded[path] = decode_unpacked_folder(unpacked, device)
                else:
                    signatures[path] = self._check_fits(path)
        finally:
            for stale in staged.values():
                stale.cancel()
        held, self._primeflow_held = self._primeflow_held, None  # until this load succeeds
        stale_mirror = False  # the mirror changed since the model was loaded from it
        for path, meta in zip(paths, metas, strict=True):
            if path in decoded:
                if held is None or held != meta.get("base_uid"):
                    raise ValueError(
                        f"{path} is a delta on version {meta.get('base')} "
                        f"(uid {meta.get('base_uid')}); this worker holds uid {held}"
                    )
                stale_mirror |= self._apply(decoded[path])
            else:
                self._load(iterate_weights(path))
                stale_mirror = False
                self._hold(path, meta, signatures[path])
            uid = meta.get("uid")
            held = str(uid) if uid is not None and self._primeflow_holding else None
        if stale_mirror:
            assert self._primeflow_mirror is not None
            self._load(iter(self._primeflow_mirror.items()))
        repacked = repack_tied_heads(self.model_runner.get_model())  # type: ignore[attr-defined]
        self._primeflow_version = int(version)
        self._primeflow_held = held
        return {
            "repacked": repacked,
            "version": self._primeflow_version,
            "holds": held,
            "unpacked_ahead": unpacked_ahead,
        }

    def _primeflow_delta_device(self) -> torch.device:
        """Where deltas are applied: the served parameters' device, or the host's mirror."""
        targets = self._primeflow_targets
        if targets:
            return next(iter(targets.values())).param.device
        return torch.device("cpu")

    @property
    def _primeflow_holding(self) -> bool:
        return self._primeflow_targets is not None or self._primeflow_mirror is not None

    def _load(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        wrapped = wrapped_for_lora(model)
        if wrapped:  # a base model's weights into a server with runtime LoRA, on vLLM 0.26
            packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
            weights = under_wrapped_names(weights, wrapped, packed)
        # The worker's own `reload_weights` sets vLLM's current config around the runner's.
        self.reload_weights(  # type: ignore[attr-defined]
            weights_iterator=weights, is_checkpoint_format=True
        )

    def _hold(self, path: Path, meta: dict[str, object], shapes: Signature) -> None:
        """After loading full version `path` (tensors of `shapes`): where its deltas will go,
        if deltas follow."""
        self._primeflow_targets, self._primeflow_mirror = None, None
        if not keeps_mirror(meta):
            return
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        dtype = getattr(torch, str(meta.get("dtype", "")), None)
        if isinstance(dtype, torch.dtype):
            self._primeflow_targets = inplace_targets(
                model.named_parameters(), shapes, dtype, packed
            )
        if self._primeflow_targets is None:
            self._primeflow_mirror = dict(iterate_weights(path))

    def _apply(self, decoded: Decoded) -> bool:
        """Apply decoded deltas in place on the served weights, or to the mirror (then True:
        the mirror must be loaded into the model). All are checked before any is applied."""
        targets, mirror = self._primeflow_targets, self._primeflow_mirror
        for part, _, _ in decoded:
            if targets is None:
                check_fits(part, (mirror or {}).get(part.name))
                continue
            target = targets.get(part.name)
            if target is None or (target.shape, target.param.dtype) != (part.shape, part.dtype):
                raise ValueError(
                    f"the delta changes {part.name} ({part.dtype}{list(part.shape)}), "
                    "which this server does not serve as such"
                )
        for part, positions, signed in decoded:
            if targets is not None:
                target = targets[part.name]
                apply_entries(target.param.data, positions, signed, target.offset)
            else:
                assert mirror is not None
                apply_entries(mirror[part.name], positions, signed)
        return targets is None

    def _check_fits(self, path: Path) -> Signature:
        """The folder's tensor shapes; refused unless they are the served model's."""
        model_config = self.model_runner.model_config  # type: ignore[attr-defined]
        if self._primeflow_reference is None:
            base = served_model_folder(model_config.model, model_config.revision)
            self._primeflow_reference = read_signature(base)
        tied = ties_word_embeddings(model_config.hf_config.to_dict())
        found = read_signature(path)
        problem = signature_mismatch(self._primeflow_reference, found, tied=tied)
        if problem:
            raise ValueError(f"checkpoint {path} does not fit the served model: {problem}")
        return found
