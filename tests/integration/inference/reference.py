"""What `transformers` computes for the same weights: the reference the servers must match."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel


@cache
def _model(folder: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.no_grad()
def token_logprobs(
    folder: Path, prompt: list[int], completion: list[int], temperature: float = 1.0
) -> list[float]:
    """Log-probabilities of `completion`'s tokens after `prompt`, at `temperature`."""
    ids = torch.tensor([prompt + completion])
    logits = _model(folder)(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    picked = torch.tensor(completion).unsqueeze(1)
    return torch.log_softmax(logits, dim=-1).gather(1, picked).squeeze(1).tolist()


@torch.no_grad()
def greedy(folder: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """Argmax decoding up to `max_tokens` or any of the model's end-of-sequence tokens.

    vLLM stops on every id in `generation_config.json`'s `eos_token_id`, and so does this.
    """
    model = _model(folder)
    output = model.generate(
        torch.tensor([prompt]),
        do_sample=False,
        max_new_tokens=max_tokens,
        eos_token_id=model.generation_config.eos_token_id,
        pad_token_id=model.generation_config.pad_token_id,
    )
    return output[0, len(prompt) :].tolist()
