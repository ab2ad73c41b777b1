"""Checkpoints: a Hugging Face folder plus the trainer state for exact resume.

`<store>/checkpoints/step_NNNNNN/` holds

- `model*.safetensors` (+ index when split), `config.json`, tokenizer and generation files:
  the full fp32 weights gathered from the FSDP shards, loadable by `transformers` and vLLM as
  they are (a tied LM head is stored once, as Hugging Face does);
- `trainer/optimizer.safetensors` (AdamW moments and step per parameter, by parameter name),
  `trainer/rng.safetensors` (each rank's CPU and CUDA generator states) and `trainer/state.json`
  (step, data position, scheduler, optimizer hyper-parameters);
- `_COMMITTED`, written last by the storage commit protocol.

Only safetensors and JSON: nothing is unpickled on resume. State dicts are full (unsharded), so
a run can resume on a different number of ranks; that costs one gather per checkpoint, which is
cheap at the model sizes one node trains.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from engine.trainer.distributed import DistInfo
from engine.trainer.model import PolicyModel
from storage.commit import begin_step, commit_step, digest_file, latest_committed_step, read_commit
from storage.commit import read_verified as _read_verified
from storage.layout import RunLayout
from storage.paths import join
from storage.store import ObjectStore

TRAINER_DIR = "trainer"
OPTIMIZER_FILE = f"{TRAINER_DIR}/optimizer.safetensors"
RNG_FILE = f"{TRAINER_DIR}/rng.safetensors"
STATE_FILE = f"{TRAINER_DIR}/state.json"
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
_KEY_SEP = "::"


def _tied_head_key(policy: PolicyModel) -> str | None:
    """The LM head's weight name when it is tied to the input embeddings (stored once)."""
    if getattr(policy.config, "tie_word_embeddings", False):
        return f"{policy.head_name}.weight"
    return None


def _embedding_key(policy: PolicyModel) -> str:
    embeddings = policy.base.get_input_embeddings()
    return next(
        f"{policy.base_name}.{name}.weight"
        for name, module in policy.base.named_modules()
        if module is embeddings
    )


def _write_weights(folder: Path, weights: dict[str, torch.Tensor], max_shard_gb: float) -> None:
    split = split_torch_state_dict_into_shards(
        weights,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=int(max_shard_gb * 1e9),
    )
    for filename, names in split.filename_to_tensors.items():
        shard = {name: weights[name].contiguous() for name in names}
        save_file(shard, str(folder / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {**split.metadata}, "weight_map": split.tensor_to_filename}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _optimizer_tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """`{param: {exp_avg, exp_avg_sq, step}}` → flat `{"param::exp_avg": tensor}` (safetensors)."""
    return {
        f"{param}{_KEY_SEP}{name}": value.detach().cpu().contiguous()
        for param, values in state.items()
        for name, value in values.items()
    }


def _optimizer_state(tensors: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        param, name = key.rsplit(_KEY_SEP, 1)
        state.setdefault(param, {})[name] = value
    return state


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def save_checkpoint(
    store: ObjectStore,
    step: int,
    policy: PolicyModel,
    optimizer: Optimizer,
    scheduler: LRScheduler,
    dist_info: DistInfo,
    *,
    progress: Mapping[str, Any],
    assets_dir: Path | None,
    max_shard_gb: float,
) -> None:
    """Gather and commit `checkpoints/step_<step>` (collective: every rank must call it).

    `progress` is the data position (JSON); `assets_dir` holds tokenizer/generation files to
    ship with the weights.
    """
    weights = get_model_state_dict(policy, options=_FULL)
    optim_state = get_optimizer_state_dict(policy, optimizer, options=_FULL)
    rng_states: list[dict[str, torch.Tensor] | None] = [None] * dist_info.world_size
    dist.all_gather_object(rng_states, _rng_state(dist_info.device))
    if dist_info.is_main:
        tied = _tied_head_key(policy)
        if tied is not None:
            weights.pop(tied, None)
        with tempfile.TemporaryDirectory(prefix="primeflow-ckpt-") as tmp:
            folder = Path(tmp)
            (folder / TRAINER_DIR).mkdir()
            _write_weights(folder, {k: v.float() for k, v in weights.items()}, max_shard_gb)
            policy.config.to_json_file(str(folder / "config.json"))
            if assets_dir is not None:
                for asset in assets_dir.iterdir():
                    shutil.copy(asset, folder / asset.name)
            save_file(_optimizer_tensors(optim_state["state"]), str(folder / OPTIMIZER_FILE))
            rng = {
                f"rank{rank}.{kind}": tensor
                for rank, states in enumerate(rng_states)
                for kind, tensor in (states or {}).items()
            }
            save_file(rng, str(folder / RNG_FILE))
            state = {
                "step": step,
                "world_size": dist_info.world_size,
                "progress": dict(progress),
                "param_groups": optim_state["param_groups"],
                "scheduler": scheduler.state_dict(),
            }
            (folder / STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True))
            commit_folder(store, RunLayout.checkpoint_dir(step), folder, step)
    dist.barrier()


def commit_folder(store: ObjectStore, step_dir: str, folder: Path, step: int) -> None:
    """Upload every file under `folder` to `step_dir`, then write its `_COMMITTED` marker."""
    begin_step(store, step_dir)
    digests = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = path.relative_to(folder).as_posix()
        digests[name] = digest_file(path)
        store.upload_file(path, join(step_dir, name))
    commit_step(store, step_dir, digests, step=step)


def fetch_folder(store: ObjectStore, step_dir: str, target: Path) -> Path:
    """Download a committed step folder into `target`, verifying every file against its marker."""
    record = read_commit(store, step_dir)
    for name, expected in record.files.items():
        path = target / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_read_verified(store, join(step_dir, name), expected))
    return target


def latest_checkpoint(store: ObjectStore) -> int | None:
    """The newest committed checkpoint step, or None (a half-written one is never chosen)."""
    return latest_committed_step(store, RunLayout.CHECKPOINTS)


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the HF folder's safetensors files."""
    weights: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("model*.safetensors")):
        weights.update(load_file(str(path)))
    return weights


def load_checkpoint(
    store: ObjectStore,
    step: int,
    policy: PolicyModel,
    optimizer: Optimizer,
    scheduler: LRScheduler,
    dist_info: DistInfo,
) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler and RNG from committed `step`; return its progress."""
    with tempfile.TemporaryDirectory(prefix="primeflow-resume-") as tmp:
        folder = fetch_folder(store, RunLayout.checkpoint_dir(step), Path(tmp))
        weights = load_weights(folder)
        tied = _tied_head_key(policy)
        if tied is not None:
            weights[tied] = weights[_embedding_key(policy)]
        optim_tensors = load_file(str(folder / OPTIMIZER_FILE))
        rng = load_file(str(folder / RNG_FILE))
        state = json.loads((folder / STATE_FILE).read_text())
    set_model_state_dict(policy, weights, options=StateDictOptions(full_state_dict=True))
    set_optimizer_state_dict(
        policy,
        optimizer,
        {"state": _optimizer_state(optim_tensors), "param_groups": state["param_groups"]},
        options=StateDictOptions(full_state_dict=True),
    )
    scheduler.load_state_dict(state["scheduler"])
    if state["world_size"] == dist_info.world_size:
        torch.set_rng_state(rng[f"rank{dist_info.rank}.cpu"])
        cuda_key = f"rank{dist_info.rank}.cuda"
        if dist_info.device.type == "cuda" and cuda_key in rng:
            torch.cuda.set_rng_state(rng[cuda_key], dist_info.device)
    return state["progress"]
