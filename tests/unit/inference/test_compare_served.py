"""The direct weight check's pure part: served vLLM parameters rebuilt from checkpoint tensors."""

from __future__ import annotations

import pytest
import torch

from engine.inference.reload_ext import (
    checkpoint_names,
    compare_served,
    inplace_targets,
    under_wrapped_names,
)
from storage.deltas import apply_entries, decode_delta, delta_between

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def checkpoint() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (10, 4),
        "model.layers.0.self_attn.q_proj.weight": (4, 4),
        "model.layers.0.self_attn.k_proj.weight": (2, 4),
        "model.layers.0.self_attn.v_proj.weight": (2, 4),
        "model.layers.0.mlp.gate_proj.weight": (6, 4),
        "model.layers.0.mlp.up_proj.weight": (6, 4),
        "model.norm.weight": (4,),
    }
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def served_from(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What vLLM holds after loading `tensors` in bf16: fused projections, a padded vocabulary."""
    attn, mlp = "model.layers.0.self_attn.", "model.layers.0.mlp."
    embed = torch.zeros(16, 4)
    embed[:10] = tensors["model.embed_tokens.weight"]
    served = {
        "model.embed_tokens.weight": embed,
        attn + "qkv_proj.weight": torch.cat([tensors[attn + f"{x}_proj.weight"] for x in "qkv"]),
        mlp + "gate_up_proj.weight": torch.cat(
            [tensors[mlp + f"{x}.weight"] for x in PACKED["gate_up_proj"]]
        ),
        "model.norm.weight": tensors["model.norm.weight"],
        "model.layers.0.self_attn.o_proj.weight": torch.empty(0),  # packed away (CPU backend)
    }
    return {name: value.to(torch.bfloat16) for name, value in served.items()}


def test_fused_names_expand_in_stacking_order() -> None:
    assert checkpoint_names("model.layers.3.self_attn.qkv_proj.weight", PACKED) == [
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.3.self_attn.k_proj.weight",
        "model.layers.3.self_attn.v_proj.weight",
    ]
    assert checkpoint_names("model.norm.weight", PACKED) == ["model.norm.weight"]


def test_a_layer_wrapped_for_runtime_lora_is_compared_with_its_base_weight() -> None:
    assert checkpoint_names("model.layers.0.mlp.gate_up_proj.base_layer.weight", PACKED) == [
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    ]


def test_served_weights_loaded_from_the_checkpoint_compare_equal() -> None:
    tensors = checkpoint()
    report = compare_served(iter(served_from(tensors).items()), tensors, PACKED)
    assert report == {
        "compared": 4,
        "mismatched": 0,
        "mismatched_names": [],
        "max_abs_diff": 0.0,
        "packed_away": 1,
        "absent": 0,
    }


def test_one_changed_entry_is_found() -> None:
    tensors = checkpoint()
    served = served_from(tensors)
    served["model.layers.0.mlp.gate_up_proj.weight"][7, 1] += 1.0  # a row of `up`
    report = compare_served(iter(served.items()), tensors, PACKED)
    assert report["mismatched"] == 1
    assert report["mismatched_names"] == ["model.layers.0.mlp.gate_up_proj.weight"]
    assert report["max_abs_diff"] == pytest.approx(1.0, abs=0.02)


def test_a_checkpoint_of_another_shape_is_an_error() -> None:
    tensors = checkpoint()
    tensors["model.norm.weight"] = torch.ones(8)
    with pytest.raises(ValueError, match=r"model\.norm\.weight: checkpoint shape"):
        compare_served(iter(served_from(checkpoint()).items()), tensors, PACKED)


def test_deltas_applied_in_place_on_fused_and_padded_parameters() -> None:
    """A GPU server's delta path: each checkpoint tensor's block of rows in the served
    parameters (q, k, v stacked in qkv_proj; padded vocabulary rows untouched)."""
    old = {name: t.to(torch.bfloat16) for name, t in checkpoint().items()}
    served = served_from(old)
    del served["model.layers.0.self_attn.o_proj.weight"]  # a GPU packs nothing away
    shapes = {name: tuple(t.shape) for name, t in old.items()}
    targets = inplace_targets(iter(served.items()), shapes, torch.bfloat16, PACKED)
    assert targets is not None and set(targets) == set(old)
    generator = torch.Generator().manual_seed(3)
    new = {
        name: (t.float() + 0.1 * torch.randn(t.shape, generator=generator)).to(torch.bfloat16)
        for name, t in old.items()
    }
    for part, positions, signed in decode_delta(delta_between(old, new)):
        target = targets[part.name]
        apply_entries(target.param, positions, signed, target.offset)
    expected = served_from(new)
    for name, param in served.items():
        assert torch.equal(param.view(torch.int16), expected[name].view(torch.int16)), name


def test_parameters_a_backend_transformed_are_not_targets() -> None:
    old = {name: t.to(torch.bfloat16) for name, t in checkpoint().items()}
    shapes = {name: tuple(t.shape) for name, t in old.items()}
    served = served_from(old)  # o_proj packed away, as on vLLM's CPU backend
    with_o_proj = {**shapes, "model.layers.0.self_attn.o_proj.weight": (4, 4)}
    assert inplace_targets(iter(served.items()), with_o_proj, torch.bfloat16, PACKED) is None
    del served["model.layers.0.self_attn.o_proj.weight"]
    assert inplace_targets(iter(served.items()), shapes, torch.bfloat16, PACKED) is not None
    assert inplace_targets(iter(served.items()), shapes, torch.float16, PACKED) is None
    sharded = {**served, "model.norm.weight": served["model.norm.weight"][:2]}
    assert inplace_targets(iter(sharded.items()), shapes, torch.bfloat16, PACKED) is None


def test_a_base_loads_under_the_names_of_the_layers_runtime_lora_wrapped() -> None:
    """vLLM 0.26 loads a LoRA-wrapped layer's weight only as `<layer>.base_layer.weight`."""
    wrapped = {"model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.down_proj"}
    weights = [
        ("model.layers.0.self_attn.k_proj.weight", torch.ones(1)),
        ("model.layers.0.mlp.down_proj.weight", torch.ones(1)),
        ("model.layers.0.mlp.up_proj.weight", torch.ones(1)),  # its layer is not wrapped here
        ("model.norm.weight", torch.ones(1)),
    ]
    renamed = [name for name, _ in under_wrapped_names(iter(weights), wrapped, PACKED)]
    assert renamed == [
        "model.layers.0.self_attn.k_proj.base_layer.weight",
        "model.layers.0.mlp.down_proj.base_layer.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.norm.weight",
    ]
    assert checkpoint_names(renamed[0].replace("k_proj", "qkv_proj"), PACKED)[1] == weights[0][0]
