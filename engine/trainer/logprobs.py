"""Log-probabilities and entropy of target tokens from hidden states, chunked over tokens.

The LM head of a modern model is large (Qwen3: 151,936 entries): full logits for a 16k-token
micro-batch are 10 GB in fp32, and the stock `model(input_ids, labels)` path materialises them
several times (bf16 logits, fp32 copy, log-softmax, their gradients). Here the head is applied
chunk by chunk inside one autograd function: forward keeps only [T] log-probs and entropies,
backward recomputes each chunk's logits and turns them straight into gradients for the hidden
states and the head weight. Peak extra memory is one chunk of logits; the price is one more
LM-head matmul in backward.

Temperature is per token: the policy that sampled token t used logits / τ_t, so the trainer's
log-probs (and the importance ratio built on them) must use the same τ_t.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

#: Logit elements per chunk (2^28 fp32 = 1 GiB): bounds memory, and is large enough that each
#: chunk's matmul still runs at full speed.
CHUNK_ELEMENTS = 2**28


def chunk_size(num_tokens: int, vocab_size: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    """Tokens per chunk so that one chunk of fp32 logits has at most `chunk_elements` entries."""
    return max(1, min(num_tokens, chunk_elements // vocab_size))


def _chunk_logits(hidden: Tensor, weight: Tensor, inv_temp: Tensor) -> Tensor:
    """[t, V] fp32 tempered logits of a chunk: (h Wᵀ) / τ."""
    return (hidden @ weight.t()).float() * inv_temp[:, None]


class _TargetLogProbs(torch.autograd.Function):
    """(hidden [T, D], weight [V, D], targets [T], inv_temp [T]) → (logprobs [T], entropy [T])."""

    @staticmethod
    def forward(
        ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, inv_temp: Tensor, chunk: int
    ) -> tuple[Tensor, Tensor]:
        num_tokens = hidden.shape[0]
        logprobs = hidden.new_empty(num_tokens, dtype=torch.float32)
        entropy = hidden.new_empty(num_tokens, dtype=torch.float32)
        for start in range(0, num_tokens, chunk):
            end = min(start + chunk, num_tokens)
            logits = _chunk_logits(hidden[start:end], weight, inv_temp[start:end])
            lse = torch.logsumexp(logits, dim=-1)
            target_logits = logits.gather(1, targets[start:end, None]).squeeze(1)
            logprobs[start:end] = target_logits - lse
            probs = torch.softmax(logits, dim=-1)
            entropy[start:end] = lse - (probs * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, inv_temp)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs: Tensor, _grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        hidden, weight, targets, inv_temp = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, hidden.shape[0])
            logits = _chunk_logits(hidden[start:end], weight, inv_temp[start:end])
            # d log p_y / d z = onehot(y) − softmax(z), and z = (h Wᵀ) / τ.
            grad_logits = torch.softmax(logits, dim=-1).neg_()
            grad_logits.scatter_add_(
                1, targets[start:end, None], torch.ones_like(grad_logits[:, :1])
            )
            grad_logits.mul_((grad_logprobs[start:end] * inv_temp[start:end])[:, None])
            grad_logits = grad_logits.to(hidden.dtype)
            grad_hidden[start:end] = grad_logits @ weight
            # Low-precision matmul (fp32 accumulate inside), chunk partial sums added in fp32.
            grad_weight += (grad_logits.t() @ hidden[start:end]).float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None


def target_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperatures: Tensor,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[Tensor, Tensor]:
    """Log π(target) and the full-distribution entropy at each position, both [T] fp32.

    hidden [T, D] (any float dtype), weight [V, D] (the LM head), targets [T] int64,
    temperatures [T] > 0. Only the log-probs carry gradients; entropy is a metric.
    """
    chunk = chunk_size(hidden.shape[0], weight.shape[0], chunk_elements)
    inv_temp = temperatures.float().reciprocal()
    return _TargetLogProbs.apply(hidden, weight, targets, inv_temp, chunk)
