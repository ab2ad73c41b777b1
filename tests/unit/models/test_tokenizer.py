"""`load_tokenizer`: the one loader of the policy's tokenizer (orchestrator, trainer, preflight)."""

from __future__ import annotations

import pytest

from engine.config import TINY_MODEL
from engine.config.model import ModelConfig
from engine.models.resolve import ModelPathError
from engine.models.tokenizer import load_tokenizer


def test_a_sections_model_name_loads_with_its_chat_template() -> None:
    tokenizer = load_tokenizer(TINY_MODEL, ModelConfig())
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")


def test_what_does_not_load_raises_its_cause_instead_of_none() -> None:
    # The trainer's loader returned None here and SFT reported "needs a tokenizer" instead.
    with pytest.raises(ModelPathError, match="model path /no/such/model does not exist"):
        load_tokenizer("/no/such/model", ModelConfig())
    with pytest.raises(OSError):  # local_only: no hub lookup on a machine without the hub
        load_tokenizer("nobody/no-such-model", ModelConfig(), local_only=True)
