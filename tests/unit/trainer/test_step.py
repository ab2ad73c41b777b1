"""One optimizer step: a batch whose gradient norm is not finite, or exactly zero (an RL batch
without advantage), leaves the weights and the optimizer's state alone; its mismatch KL is
split between samples of the weights being trained and older ones.

The same check runs on GPU (`tests/gpu`), where fused AdamW skips on the device instead of the
host reading the norm first.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.config.trainer import AipoLossConfig, ConstantSchedulerConfig, OptimizerConfig
from engine.trainer.batching import micro_batches
from engine.trainer.distributed import init_distributed
from engine.trainer.loss import LossFn, LossInputs, LossOutputs, build_loss, sft_loss
from engine.trainer.model import ModelOptions, build_policy, compute_dtype, load_causal_lm
from engine.trainer.optim import build_optimizer
from engine.trainer.packing import Sample, pack_samples
from engine.trainer.schedule import build_scheduler
from engine.trainer.step import StepContext, lag_split, lag_split_means, train_step


def scaled_sft_loss(factor: float) -> LossFn:
    """The SFT loss times `factor`: NaN makes a non-finite gradient, 0 the gradient of an RL
    batch whose groups all tied (every advantage 0)."""

    def loss(inputs: LossInputs) -> LossOutputs:
        outputs = sft_loss(inputs)
        return replace(outputs, token_loss=outputs.token_loss * factor)

    return loss


nan_loss = scaled_sft_loss(float("nan"))
zero_loss = scaled_sft_loss(0.0)


def two_steps(
    model_dir: Path,
    first: LossFn,
    backend: str = "gloo",
    second: LossFn = sft_loss,
    lags: tuple[int, int, int] = (0, 0, 0),
) -> list[dict]:
    """Step with `first`, then with `second`, on three samples `lags` versions behind; per
    step its metrics, the weights after it (full tensors, on the CPU) and the optimizer's step
    counts."""
    dist = init_distributed(backend)  # type: ignore[arg-type]
    dtype = compute_dtype("auto", dist.device)
    options = ModelOptions(compute_dtype=dtype)
    policy = build_policy(load_causal_lm(str(model_dir), options), dist.mesh, dist.device, options)
    ctx = StepContext(policy=policy, dist=dist, compute_dtype=dtype)
    optimizer = build_optimizer(policy, OptimizerConfig(lr=1e-2), dist.device)
    scheduler = build_scheduler(optimizer, ConstantSchedulerConfig(), 10)
    rng = np.random.default_rng(0)
    samples = [
        Sample(rng.integers(0, 100, n), np.ones(n, bool), np.full(n, -4.0, np.float32), lag=lag)
        for n, lag in zip((30, 20, 40), lags, strict=True)
    ]
    rows = pack_samples(samples, 64)
    loss_tokens = int(rows.loss_mask.sum())

    def weights() -> dict[str, torch.Tensor]:
        return {
            name: getattr(p, "full_tensor", lambda p=p: p)().detach().float().cpu().clone()
            for name, p in policy.named_parameters()
        }

    results = [{"metrics": {}, "weights": weights(), "steps": []}]
    for loss_fn in (first, second):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            metrics = train_step(
                ctx, optimizer, scheduler, micro_batches(rows, 2), loss_fn, loss_tokens, 1.0
            )
        # A skipped first step moves the schedule on purpose: no PyTorch warning about it.
        assert not [w for w in caught if "lr_scheduler" in str(w.message)]
        steps = [float(state["step"]) for state in optimizer.state.values() if "step" in state]
        results.append({"metrics": metrics, "weights": weights(), "steps": steps})
    return results


def check_skip_then_step(results: list[dict]) -> None:
    start, skipped, stepped = results
    assert skipped["metrics"]["skipped"] == 1.0
    assert not np.isfinite(skipped["metrics"]["grad_norm"])
    for name, tensor in start["weights"].items():
        torch.testing.assert_close(skipped["weights"][name], tensor, rtol=0, atol=0, msg=name)
    assert set(skipped["steps"]) <= {0.0}, "a skipped step must not count for Adam"
    assert stepped["metrics"]["skipped"] == 0.0
    assert stepped["steps"] and set(stepped["steps"]) == {1.0}
    assert any(
        not torch.equal(stepped["weights"][name], tensor)
        for name, tensor in start["weights"].items()
    )


def test_a_non_finite_gradient_skips_the_update(tiny_model_dir: Path) -> None:
    check_skip_then_step(two_steps(tiny_model_dir, nan_loss))


def check_step_then_no_signal(results: list[dict]) -> None:
    _, stepped, idle = results
    assert stepped["metrics"]["skipped"] == 0.0 and set(stepped["steps"]) == {1.0}
    assert idle["metrics"]["skipped"] == 1.0 and idle["metrics"]["grad_norm"] == 0.0
    # Without the skip AdamW's momentum and weight decay would move every weight again.
    for name, tensor in stepped["weights"].items():
        torch.testing.assert_close(idle["weights"][name], tensor, rtol=0, atol=0, msg=name)
    assert set(idle["steps"]) == {1.0}, "a step without signal must not count for Adam"


def test_a_step_without_signal_leaves_the_weights_and_the_moments_alone(
    tiny_model_dir: Path,
) -> None:
    check_step_then_no_signal(two_steps(tiny_model_dir, sft_loss, second=zero_loss))


def test_the_mismatch_kl_splits_by_lag() -> None:
    kl = torch.tensor([0.1, 0.2, 0.3, 0.4, 9.0])
    loss_mask = torch.tensor([True, True, True, True, False])
    stale = torch.tensor([False, False, True, True, True])
    sums = {key: float(value) for key, value in lag_split(kl, loss_mask, stale).items()}
    means = lag_split_means({**sums, "loss": 1.0})
    assert means == {
        "stale_token_fraction": 0.5,
        "mismatch_kl_stale": pytest.approx(0.35),
        "mismatch_kl_fresh": pytest.approx(0.15),
    }
    assert lag_split_means({"loss": 1.0}) == {}  # a loss without a mismatch KL (SFT)
    on_policy = lag_split(kl, loss_mask, torch.zeros(5, dtype=torch.bool))
    means = lag_split_means({key: float(value) for key, value in on_policy.items()})
    assert means == {"stale_token_fraction": 0.0, "mismatch_kl_fresh": pytest.approx(0.25)}


def test_a_step_reports_the_mismatch_kl_of_stale_and_fresh_samples(tiny_model_dir: Path) -> None:
    """Three samples of 30, 20 and 40 tokens, the 20 one a version behind: the stale share of
    loss tokens is 19 / 87, and the two means average back to the step's mismatch KL."""
    aipo = build_loss(AipoLossConfig())
    _, stepped, _ = two_steps(tiny_model_dir, aipo, second=aipo, lags=(0, 1, 0))
    metrics = stepped["metrics"]
    assert metrics["stale_token_fraction"] == pytest.approx(19 / 87)
    share = metrics["stale_token_fraction"]
    assert metrics["mismatch_kl_stale"] > 0 and metrics["mismatch_kl_fresh"] > 0
    blended = share * metrics["mismatch_kl_stale"] + (1 - share) * metrics["mismatch_kl_fresh"]
    assert blended == pytest.approx(metrics["mismatch_kl"], rel=1e-5)
