"""A resume checkpoint copied to the host behind the next steps holds the state of its own step.

The snapshot's device-to-host copies run on a side stream while training goes on; the next
optimizer step changes the weights and moments in place, so it must wait for them. Here the
next steps follow at once (no forward to hide behind) on a model whose fp32 state takes
~0.1 s to copy, so a missing wait would leave later values in the checkpoint.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import Qwen3Config

from engine.config.trainer import CheckpointConfig, ConstantSchedulerConfig, OptimizerConfig
from engine.trainer.checkpoint_state import model_tensors
from engine.trainer.checkpoint_writer import CheckpointWriter
from engine.trainer.distributed import DistInfo, close_distributed, init_distributed
from engine.trainer.model import ModelOptions, PolicyModel, build_policy, causal_lm_from_config
from engine.trainer.optim import build_optimizer
from engine.trainer.schedule import build_scheduler
from storage.checkpoints import fetch_checkpoint, load_checkpoint_weights, load_trainer_state
from storage.store import ObjectStore

pytestmark = pytest.mark.gpu

# ~0.5B parameters: 6 GB of fp32 weights and moments.
CONFIG = Qwen3Config(
    vocab_size=32000, hidden_size=2048, intermediate_size=6144, num_hidden_layers=8,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
)  # fmt: skip


@pytest.fixture
def dist_info() -> Iterator[DistInfo]:
    info = init_distributed("auto")
    yield info
    close_distributed()


def optimizer_step(policy: PolicyModel, optimizer: torch.optim.Optimizer) -> None:
    for param in policy.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()


def host_state(policy: PolicyModel, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The weights and first moments now, copied synchronously."""

    def full(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        return tensor.detach().cpu().clone()

    state = {name: full(tensor) for name, tensor in model_tensors(policy)}
    names = {id(param): name for name, param in policy.named_parameters()}
    for param, values in optimizer.state.items():
        state[f"exp_avg/{names[id(param)]}"] = full(values["exp_avg"])
    return state


def test_the_next_steps_wait_for_the_checkpoint_copies(tmp_path: Path, dist_info: DistInfo) -> None:
    policy = build_policy(
        causal_lm_from_config(CONFIG),
        dist_info.mesh,
        dist_info.device,
        ModelOptions(compute_dtype=torch.bfloat16),
    )
    optimizer = build_optimizer(policy, OptimizerConfig(lr=1e-2), dist_info.device)
    scheduler = build_scheduler(optimizer, ConstantSchedulerConfig(), 100)
    optimizer_step(policy, optimizer)
    torch.cuda.synchronize()
    expected = host_state(policy, optimizer)

    store = ObjectStore(f"file://{tmp_path}/run")
    writer = CheckpointWriter(
        store, policy, optimizer, scheduler, dist_info, files={},
        config=CheckpointConfig(keep_last=None),
    )  # fmt: skip
    writer.save(1, {})
    for _ in range(3):
        optimizer_step(policy, optimizer)
    writer.flush()
    after = host_state(policy, optimizer)

    with tempfile.TemporaryDirectory() as tmp:
        folder = fetch_checkpoint(store, 1, Path(tmp) / "ckpt", trainer_state=True)
        weights = load_checkpoint_weights(folder)
        moments = load_trainer_state(folder).tensors
    changed = 0
    for name, tensor in expected.items():
        if name.startswith("exp_avg/"):
            saved = moments[f"optimizer/{name.removeprefix('exp_avg/')}/exp_avg"]
        else:
            saved = weights[name]
        assert torch.equal(saved, tensor), name
        changed += not torch.equal(after[name], tensor)
    assert changed > len(expected) / 2, "the later steps must have changed the state"
