"""The offline tiny model: deterministic bytes, loadable by transformers, a working tokenizer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.config import TINY_MODEL
from engine.models import TinyModelSpec, cached_tiny_model, resolve_model, write_tiny_model
from engine.models.char_tokenizer import CHARACTERS, SPECIAL_TOKENS


def _files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_same_spec_writes_the_same_bytes(tmp_path: Path) -> None:
    first = _files(write_tiny_model(tmp_path / "a"))
    second = _files(write_tiny_model(tmp_path / "b"))
    assert set(first) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert first == second


def test_seed_changes_the_weights_only(tmp_path: Path) -> None:
    base = _files(write_tiny_model(tmp_path / "a", TinyModelSpec(seed=0)))
    other = _files(write_tiny_model(tmp_path / "b", TinyModelSpec(seed=1)))
    assert [name for name in base if base[name] != other[name]] == ["model.safetensors"]


@pytest.mark.parametrize("tied", [True, False])
def test_transformers_loads_exactly_the_written_weights(tmp_path: Path, tied: bool) -> None:
    folder = write_tiny_model(tmp_path, TinyModelSpec(tie_word_embeddings=tied))
    written = load_file(folder / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(folder)
    state = model.state_dict()
    assert model.config.model_type == "qwen3"
    assert model.config.vocab_size == len(SPECIAL_TOKENS) + len(CHARACTERS) == 101
    for name, tensor in written.items():
        assert torch.equal(state[name], tensor), name
    head_is_embedding = torch.equal(state["lm_head.weight"], written["model.embed_tokens.weight"])
    assert head_is_embedding == tied
    assert ("lm_head.weight" in written) != tied
    assert 400_000 < sum(p.numel() for p in model.parameters()) < 500_000


def test_chat_template_renders_chatml(tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(write_tiny_model(tmp_path))
    messages = [
        {"role": "system", "content": "Reverse the text."},
        {"role": "user", "content": "abc"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nReverse the text.<|im_end|>\n"
        "<|im_start|>user\nabc<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    # One id per ChatML marker and one per remaining character.
    markers = text.count("<|im_start|>") + text.count("<|im_end|>")
    plain = text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    assert len(ids) == markers + len(plain)
    assert tokenizer.eos_token == "<|im_end|>"
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


@pytest.mark.parametrize(
    "text", ["", "Hello, world!", "line one\n\tline two ~{}", "".join(CHARACTERS)]
)
def test_tokenizer_round_trips_text(tmp_path: Path, text: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(write_tiny_model(tmp_path))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text


def test_characters_outside_the_vocabulary_become_unk(tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(write_tiny_model(tmp_path))
    ids = tokenizer("aé", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["a", "<|unk|>"]


def test_tiny_model_name_resolves_to_one_cached_build(tmp_path: Path) -> None:
    path = Path(resolve_model(TINY_MODEL, cache_dir=tmp_path))
    assert path.parent == tmp_path / "models"
    assert _files(path) == _files(write_tiny_model(tmp_path / "fresh"))
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert cached_tiny_model(cache_dir=tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "models").iterdir()] == [path.name]


def test_other_names_pass_through_unchanged(tmp_path: Path) -> None:
    assert resolve_model("Qwen/Qwen3-0.6B", cache_dir=tmp_path) == "Qwen/Qwen3-0.6B"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    assert resolve_model(str(mine), cache_dir=tmp_path) == str(mine)
    assert not (tmp_path / "models").exists()


def test_naming_a_built_model_loads_neither_torch_nor_transformers(tmp_path: Path) -> None:
    """Flow runs, the command line and the orchestrator resolve the name of a model built
    already: torch and transformers (~2 s to import on the 2-core machine) are for building
    it, and for the processes that load it."""
    resolve_model(TINY_MODEL, cache_dir=tmp_path)  # built here, in this process
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from engine.models import resolve_model\n"
        f"print(resolve_model({TINY_MODEL!r}, cache_dir=Path({str(tmp_path)!r})))\n"
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.splitlines()
    assert Path(out[0]).parent == tmp_path / "models" and out[1] == "[]", out
