"""AIPO cap, masked-ratio masking and KL, normalisation, and custom losses on hand-made tensors."""

from __future__ import annotations

import math

import pytest
import torch

from engine.config.plugin import CustomPluginConfig
from engine.config.trainer import AipoLossConfig, MaskedRatioLossConfig
from engine.trainer.loss import (
    LossInputs,
    LossOutputs,
    aipo_loss,
    build_loss,
    masked_ratio_loss,
    masked_sums,
    normalise,
)


def inputs(ratios: list[float], advantages: list[float], mask: list[bool]) -> LossInputs:
    inference = torch.full((len(ratios),), -1.0)
    logprobs = (inference + torch.log(torch.tensor(ratios))).requires_grad_(True)
    return LossInputs(
        logprobs=logprobs,
        inference_logprobs=inference,
        advantages=torch.tensor(advantages),
        loss_mask=torch.tensor(mask),
    )


def test_aipo_caps_the_weight_but_keeps_the_gradient() -> None:
    x = inputs([0.5, 1.0, 20.0, 3.0], [1.0, -2.0, 1.0, 1.0], [True, True, True, False])
    out = aipo_loss(x, ratio_cap=8.0)
    loss, metrics = masked_sums(out, x.loss_mask)
    loss.backward()
    # d loss / d logprob = -min(r, cap) * A on loss tokens, 0 off the mask.
    expected = torch.tensor([-0.5, 2.0, -8.0, 0.0])
    torch.testing.assert_close(x.logprobs.grad, expected)
    assert metrics["capped_fraction"].item() == 1.0  # one of the three loss tokens
    assert metrics["ratio"].item() == pytest.approx(0.5 + 1.0 + 8.0)
    # The value: -Σ w A logπ over loss tokens.
    logp = x.logprobs.detach()
    value = -(0.5 * 1 * logp[0] + 1.0 * -2 * logp[1] + 8.0 * 1 * logp[2])
    assert loss.item() == pytest.approx(value.item(), rel=1e-6)


def test_aipo_never_overflows_on_wild_ratios() -> None:
    x = inputs([1e30, 1e-30], [1.0, 1.0], [True, True])
    out = aipo_loss(x, ratio_cap=8.0)
    assert torch.isfinite(out.token_loss).all()
    assert torch.isfinite(out.metrics["mismatch_kl"]).all()


def test_masked_ratio_masks_outside_band_and_adds_log_ratio_squared() -> None:
    x = inputs([0.25, 1.0, 1.5, 4.0], [1.0, 1.0, 1.0, 1.0], [True, True, True, True])
    out = masked_ratio_loss(x, ratio_low=0.5, ratio_high=2.0, kl_coef=0.1)
    loss, metrics = masked_sums(out, x.loss_mask)
    loss.backward()
    lr = torch.log(torch.tensor([0.25, 1.0, 1.5, 4.0]))
    kept = torch.tensor([0.0, 1.0, 1.0, 0.0])
    expected = -kept * torch.exp(lr) + 0.1 * 2 * lr
    torch.testing.assert_close(x.logprobs.grad, expected)
    assert metrics["masked_fraction"].item() == 2.0


def test_mismatch_kl_is_zero_on_policy_and_positive_off() -> None:
    on = aipo_loss(inputs([1.0, 1.0], [1.0, 1.0], [True, True]), ratio_cap=8.0)
    assert on.metrics["mismatch_kl"].abs().max().item() == 0.0
    off = aipo_loss(inputs([2.0], [1.0], [True]), ratio_cap=8.0)
    assert off.metrics["mismatch_kl"].item() == pytest.approx(1.0 - math.log(2.0))


def test_normalise_counts_global_tokens_and_undoes_fsdp_averaging() -> None:
    total = torch.tensor(6.0)
    assert normalise(total, global_loss_tokens=12, world_size=2).item() == pytest.approx(1.0)


def doubled_sft(inputs: LossInputs, scale: float = 1.0) -> LossOutputs:
    """A custom loss for the plugin test: scale × NLL."""
    return LossOutputs(
        token_loss=-scale * inputs.logprobs, metrics={"seen": torch.ones_like(inputs.logprobs)}
    )


def test_custom_loss_loads_by_import_path_with_kwargs() -> None:
    config = CustomPluginConfig(
        import_path="tests.unit.trainer.test_loss:doubled_sft", kwargs={"scale": 2.0}
    )
    fn = build_loss(config)
    x = inputs([1.0, 1.0], [0.0, 0.0], [True, False])
    loss, metrics = masked_sums(fn(x), x.loss_mask)
    assert loss.item() == pytest.approx(2.0)
    assert metrics["seen"].item() == 1.0


def test_custom_loss_import_errors_name_the_path() -> None:
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        build_loss(CustomPluginConfig(import_path="no_such_module:fn"))
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        build_loss(CustomPluginConfig(import_path="tests.unit.trainer.test_loss:missing"))


def test_builtin_configs_build() -> None:
    assert build_loss(AipoLossConfig()).keywords == {"ratio_cap": 8.0}
    assert build_loss(MaskedRatioLossConfig()).keywords["kl_coef"] == 1e-3
