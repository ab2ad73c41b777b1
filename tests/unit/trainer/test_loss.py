"""AIPO cap, masked-ratio masking and KL, normalisation, and custom losses on hand-made tensors."""

from __future__ import annotations

import math

import pytest
import torch

from engine.config.plugin import CustomPluginConfig
from engine.config.trainer import (
    AipoLossConfig,
    MaskedRatioLossConfig,
    PolicyGradientLossConfig,
    PpoClipLossConfig,
)
from engine.trainer.loss import (
    LossInputs,
    LossOutputs,
    aipo_loss,
    build_loss,
    loss_normalization,
    masked_ratio_loss,
    masked_sums,
    normalise,
    policy_gradient_loss,
    ppo_clip_loss,
    sequence_weights,
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
    assert build_loss(PpoClipLossConfig()).keywords == {"clip_low": 0.2, "clip_high": 0.28}
    assert build_loss(PolicyGradientLossConfig()) is policy_gradient_loss
    assert loss_normalization(AipoLossConfig(normalization="sequence")) == "sequence"
    assert loss_normalization(CustomPluginConfig(import_path="a.b:c")) == "token"


def test_policy_gradient_weighs_every_token_one_whatever_sampled_it() -> None:
    x = inputs([0.5, 1.0, 20.0, 3.0], [1.0, -2.0, 1.0, 1.0], [True, True, True, False])
    out = policy_gradient_loss(x)
    loss, metrics = masked_sums(out, x.loss_mask)
    loss.backward()
    # d loss / d logprob = -A on loss tokens, whatever the ratio; 0 off the mask.
    torch.testing.assert_close(x.logprobs.grad, torch.tensor([-1.0, 2.0, -1.0, 0.0]))
    assert metrics["ratio"].item() == pytest.approx(0.5 + 1.0 + 20.0)  # reported, not used
    assert metrics["mismatch_kl"].item() > 0


def test_ppo_clip_zeroes_the_gradient_only_past_the_clip_in_the_advantage_direction() -> None:
    # r = 0.5 with A < 0 and r = 1.5 with A > 0 are clipped; r = 1.5 with A < 0 and r = 0.5
    # with A > 0 still learn (the pessimistic branch is the unclipped one).
    ratios, advantages = [0.5, 1.5, 1.5, 0.5, 1.1], [-1.0, 2.0, -1.0, 1.0, 1.0]
    x = inputs(ratios, advantages, [True] * 5)
    out = ppo_clip_loss(x, clip_low=0.2, clip_high=0.28)
    loss, metrics = masked_sums(out, x.loss_mask)
    loss.backward()
    # d(-r·A)/d logπ = -r·A where unclipped; 0 where the clip holds.
    expected = torch.tensor([0.0, 0.0, 1.5, -0.5, -1.1])
    torch.testing.assert_close(x.logprobs.grad, expected)
    assert metrics["clip_low_fraction"].item() == 1.0
    assert metrics["clip_high_fraction"].item() == 1.0
    clipped_values = -(0.8 * -1.0) - 1.28 * 2.0 + 1.5 * 1.0 - 0.5 * 1.0 - 1.1 * 1.0
    assert loss.item() == pytest.approx(clipped_values, rel=1e-5)


def test_entropy_bonus_subtracts_coef_times_entropy_from_every_token() -> None:
    x = inputs([1.0, 1.0], [1.0, -1.0], [True, True])
    entropy = torch.tensor([0.3, 1.2], requires_grad=True)
    x = LossInputs(x.logprobs, x.inference_logprobs, x.advantages, x.loss_mask, entropy)
    plain = build_loss(AipoLossConfig())(x).token_loss
    bonus = build_loss(AipoLossConfig(entropy_coef=0.1))(x)
    torch.testing.assert_close(bonus.token_loss, plain - 0.1 * entropy)
    bonus.token_loss.sum().backward()
    torch.testing.assert_close(entropy.grad, torch.tensor([-0.1, -0.1]))
    with pytest.raises(ValueError, match=r"needs LossInputs\.entropy"):
        build_loss(AipoLossConfig(entropy_coef=0.1))(inputs([1.0], [1.0], [True]))


def test_sequence_weights_average_each_sample_then_the_samples() -> None:
    lengths = [2, 6, 4]
    weights = sequence_weights(lengths)
    # Each sample's tokens sum to L/N, the step's to L (what `normalise` divides by).
    assert [w * n for w, n in zip(weights, lengths, strict=True)] == pytest.approx([4.0] * 3)
    token_losses = [torch.full((n,), float(i + 1)) for i, n in enumerate(lengths)]
    weighted = sum((w * t).sum() for w, t in zip(weights, token_losses, strict=True))
    per_sample_mean = sum(t.mean() for t in token_losses) / len(lengths)
    assert (weighted / sum(lengths)).item() == pytest.approx(per_sample_mean.item())
    assert sequence_weights([0, 3]) == [0.0, 0.5]
