"""The trainer on GPUs: 2 NCCL ranks equal 1, bf16 + compile, FA2 varlen keeps samples apart."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.run import run_store as open_run_store
from engine.trainer.attention import document_kwargs, sdpa_priority, varlen_available
from engine.trainer.loss import sft_loss
from engine.trainer.model import ModelOptions, PolicyModel, load_causal_lm
from engine.trainer.packing import Sample, pack_samples
from engine.trainer.pool import run_trainer
from storage.checkpoints import fetch_checkpoint, load_checkpoint_weights
from storage.metrics import read_metrics
from tests.integration.trainer.conftest import make_config, write_steps
from tests.unit.trainer.test_step import (
    check_skip_then_step,
    check_step_then_no_signal,
    nan_loss,
    two_steps,
    zero_loss,
)

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def weights(config, step: int) -> dict[str, torch.Tensor]:
    with tempfile.TemporaryDirectory() as tmp:
        return load_checkpoint_weights(
            fetch_checkpoint(open_run_store(config), step, Path(tmp) / "ckpt")
        )


def run(tmp_path: Path, model: Path, name: str, nproc: int, **trainer) -> list[dict]:
    config = make_config(
        tmp_path,
        model,
        name,
        max_steps=2,
        trainer={"parallel": {"nproc_per_node": nproc, "backend": "nccl"}, **trainer},
    )
    write_steps(config, range(1, 3))
    assert run_trainer(config, "rl") == 0
    return config


@two_gpus
def test_two_nccl_ranks_take_the_same_steps_as_one(tmp_path: Path, tiny_model_dir: Path) -> None:
    # fp32 (TF32 off by default): the ranks differ only in the order of sums.
    configs = {n: run(tmp_path, tiny_model_dir, f"nccl-{n}", n, dtype="float32") for n in (1, 2)}
    one, two = (read_metrics(open_run_store(configs[n]), "rl") for n in (1, 2))
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "grad_norm", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    w1, w2 = weights(configs[1], 2), weights(configs[2], 2)
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-4, atol=1e-5, msg=name)


@two_gpus
def test_bf16_compiled_run_on_two_gpus_tracks_fp32(tmp_path: Path, tiny_model_dir: Path) -> None:
    fp32 = run(tmp_path, tiny_model_dir, "fp32", 1, dtype="float32")
    bf16 = run(tmp_path, tiny_model_dir, "bf16", 2, dtype="bfloat16", compile=True)
    reference, got = (read_metrics(open_run_store(c), "rl") for c in (fp32, bf16))
    for a, b in zip(reference, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=5e-2, abs=2e-2)
        assert b["peak_memory_gib"] > 0 and b["mfu"] > 0
    w32, w16 = weights(fp32, 2), weights(bf16, 2)
    assert all(w16[n].dtype == torch.float32 for n in w16), "masters stay fp32"
    for name in w32:
        torch.testing.assert_close(w16[name], w32[name], rtol=0, atol=5e-3, msg=name)


def test_varlen_packed_rows_equal_unpacked_samples(tiny_model_dir: Path) -> None:
    device = torch.device("cuda")
    assert varlen_available(device, torch.bfloat16)
    causal_lm = load_causal_lm(str(tiny_model_dir), ModelOptions())
    policy = PolicyModel(causal_lm).to(device=device, dtype=torch.bfloat16).eval()
    rng = np.random.default_rng(0)
    samples = [
        Sample(rng.integers(0, 101, n), np.ones(n, bool), np.zeros(n, np.float32))
        for n in (40, 25, 70, 13, 60)
    ]
    rows = pack_samples(samples, seq_len=128)

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    with torch.no_grad(), sdpa_priority(device):
        kwargs = document_kwargs(rows.doc_lens, 128, device, varlen=True)
        packed, _ = policy(
            t(rows.input_ids), t(rows.position_ids), t(rows.targets), t(rows.temperatures), **kwargs
        )
        for r, members in enumerate(rows.sample_index):
            start = 0
            for index in members:
                ids = t(samples[index].token_ids)[None]
                n = ids.shape[1]
                alone, _ = policy(
                    ids, torch.arange(n, device=device)[None], ids.roll(-1, 1), torch.ones_like(ids)
                )
                offset = r * 128 + start
                # bf16 activations: both paths round alike, so they agree to bf16 precision.
                torch.testing.assert_close(
                    packed[offset : offset + n - 1], alone[: n - 1], atol=3e-2, rtol=3e-2
                )
                start += n


def test_a_non_finite_gradient_skips_the_fused_update_on_the_device(tiny_model_dir: Path) -> None:
    # Fused AdamW gets the verdict as a device tensor (`found_inf`); nothing reads the norm first.
    check_skip_then_step(two_steps(tiny_model_dir, nan_loss, backend="nccl"))


def test_a_step_without_signal_skips_the_fused_update_on_the_device(tiny_model_dir: Path) -> None:
    check_step_then_no_signal(two_steps(tiny_model_dir, sft_loss, "nccl", second=zero_loss))
