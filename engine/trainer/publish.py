"""Policy versions: what a server loads, published after every RL step, off the training path.

A resume checkpoint (fp32 masters, AdamW moments, RNG) is ~12 bytes a parameter and written
every `checkpoint.interval` steps; a server needs only the weights in its serving dtype (2 bytes
a parameter for bf16). After the optimizer step the trainer *snapshots* the policy: every
parameter is gathered one at a time (a collective, so every rank takes part), cast to the serving
dtype on the device and copied to host memory on rank 0. A background thread then encodes,
hashes, writes and commits `policies/step_N` (the usual Hugging Face folder and `_COMMITTED`)
and applies retention, while the next step trains. One publication is in flight at a time: the
next snapshot first waits for it, and that wait is the step's `publish_wait_seconds`.

The cast is the one the server would make (`Tensor.to`, round to nearest even), so the served
weights are bit-identical to the trainer's, which `inference.verify_reloads` checks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from engine.config.trainer import PolicyConfig
from engine.trainer.distributed import DistInfo
from engine.trainer.model import PolicyModel
from storage.checkpoints import apply_retention, write_checkpoint
from storage.commit import committed_steps, delete_step
from storage.layout import RunLayout
from storage.paths import join
from storage.store import ObjectStore

#: Sharded state dict: names cleaned of wrappers, no gather (each tensor gathered on its own).
_SHARDED = StateDictOptions(full_state_dict=False)


def serving_dtype(config: Any) -> torch.dtype:
    """The dtype a server loads the model in: the model config's (`dtype`), fp32 if unset."""
    name = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(name, torch.dtype):
        return name
    return getattr(torch, str(name)) if name and str(name) != "auto" else torch.float32


def snapshot_weights(
    policy: PolicyModel, dtype: torch.dtype, dist_info: DistInfo, skip: str | None
) -> dict[str, torch.Tensor]:
    """Full tensors in `dtype` on rank 0's host (empty elsewhere); collective.

    One parameter is gathered at a time, so no rank ever holds a second copy of the whole model
    on the device. Host copies go to pinned memory on CUDA, so the copy does not stall on paging.
    """
    weights: dict[str, torch.Tensor] = {}
    pin = dist_info.device.type == "cuda"
    for name, tensor in get_model_state_dict(policy, options=_SHARDED).items():
        if name == skip:
            continue
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if dist_info.is_main:
            cast = full.detach().to(dtype)
            host = torch.empty(cast.shape, dtype=dtype, pin_memory=pin)
            host.copy_(cast, non_blocking=pin)
            weights[name] = host
    if pin:
        torch.cuda.synchronize(dist_info.device)
    return weights


class PolicyPublisher:
    """Publishes policy versions of one RL run from rank 0 on a background thread.

    `lineage` is the resume checkpoint's step the trainer started from (0: a fresh start),
    recorded in every version's commit meta so an audit can tell a version written before a
    resume from one written after it.
    """

    def __init__(
        self,
        store: ObjectStore,
        policy: PolicyModel,
        dist_info: DistInfo,
        *,
        config: PolicyConfig,
        files: Mapping[str, bytes],
        tied_head: str | None,
        lineage: int,
    ) -> None:
        self.store = store
        self.policy = policy
        self.dist_info = dist_info
        self.config = config
        self.files = dict(files)
        self.tied_head = tied_head
        self.lineage = lineage
        self.dtype = serving_dtype(policy.config)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def publish(self, step: int) -> dict[str, float]:
        """Snapshot the policy as version `step` and write it in the background (collective).

        Returns the seconds this step stalled: waiting for the previous publication and taking
        the snapshot. A failed earlier publication is raised here.
        """
        started = time.perf_counter()
        self.flush()
        waited = time.perf_counter() - started
        weights = snapshot_weights(self.policy, self.dtype, self.dist_info, self.tied_head)
        if self.dist_info.is_main:
            self._thread = threading.Thread(
                target=self._write, args=(step, weights), name=f"publish-{step}", daemon=True
            )
            self._thread.start()
        return {
            "publish_wait_seconds": waited,
            "publish_snapshot_seconds": time.perf_counter() - started - waited,
        }

    def flush(self) -> None:
        """Wait for the publication in flight; raise its error, if it failed."""
        self.close()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"publishing a policy version failed: {error}") from error

    def close(self) -> None:
        """Wait for the publication in flight, if any, without raising (on the way out of a
        failed stage: its own error is the one to report)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _write(self, step: int, weights: dict[str, torch.Tensor]) -> None:
        try:
            write_checkpoint(
                self.store,
                step,
                weights=weights,
                config=self.policy.config.to_dict(),
                files=self.files,
                parent=RunLayout.POLICIES,
                meta={"dtype": str(self.dtype).removeprefix("torch."), "lineage": self.lineage},
            )
            apply_retention(
                self.store,
                keep_last=self.config.keep_last,
                keep_every=self.config.keep_every,
                parent=RunLayout.POLICIES,
            )
        except BaseException as exc:  # surfaced on the trainer's thread by `flush`
            self._error = exc

    def forget_after(self, step: int) -> list[int]:
        """Delete committed versions newer than `step` (rank 0; collective): a resumed trainer's
        lineage starts again at its checkpoint, and a server must never load a version of the
        old one. The other ranks wait, so none lists the folder while it changes."""
        newer: list[int] = []
        if self.dist_info.is_main:
            newer = [s for s in committed_steps(self.store, RunLayout.POLICIES) if s > step]
            for stale in newer:
                delete_step(self.store, join(RunLayout.POLICIES, RunLayout.step_name(stale)))
        if dist.is_initialized():
            dist.barrier()
        return newer
