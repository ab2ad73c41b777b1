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

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

#: Logit elements per chunk (2^28 fp32 = 1 GiB): bounds memory, and is large enough that each
#: chunk's matmul still runs at full speed.
CHUNK_ELEMENTS = 2**28


def chunk_size(num_tokens: int, vocab_size: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    """Tokens per chunk so that one chunk of fp32 logits has at most `chunk_elements` entries."""
    return max(1, min(num_tokens, chunk_elements // vocab_size))


def _stats(logits: Tensor, targets: Tensor, inv_temp: Tensor) -> tuple[Tensor, Tensor]:
    """logits [t, V] (h Wᵀ) → log p(target) [t] and entropy [t] of softmax(logits / τ)."""
    z = logits.float() * inv_temp[:, None]
    lse = torch.logsumexp(z, dim=-1)
    target = z.gather(1, targets[:, None]).squeeze(1)
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    return target - lse, entropy


def _grad_logits(logits: Tensor, targets: Tensor, inv_temp: Tensor, grad: Tensor) -> Tensor:
    """d Σ grad·log p(target) / d logits, [t, V] in the logits' dtype.

    d log p_y / d z = onehot(y) − softmax(z), and z = logits / τ.
    """
    z = logits.float() * inv_temp[:, None]
    vocab = torch.arange(z.shape[1], device=z.device)
    onehot = (vocab[None, :] == targets[:, None]).float()
    return ((onehot - torch.softmax(z, dim=-1)) * (grad * inv_temp)[:, None]).to(logits.dtype)


def _grad_logits_with_entropy(
    logits: Tensor, targets: Tensor, inv_temp: Tensor, grad: Tensor, grad_entropy: Tensor
) -> Tensor:
    """d Σ (grad·log p(target) + grad_entropy·H) / d logits, [t, V] in the logits' dtype.

    With H = −Σ p log p: d H / d z_k = −p_k (log p_k + H), and z = logits / τ.
    """
    z = logits.float() * inv_temp[:, None]
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    entropy = -(p * logp).sum(-1, keepdim=True)
    vocab = torch.arange(z.shape[1], device=z.device)
    onehot = (vocab[None, :] == targets[:, None]).float()
    dz = (onehot - p) * grad[:, None] - p * (logp + entropy) * grad_entropy[:, None]
    return (dz * inv_temp[:, None]).to(logits.dtype)


# On GPU the element-wise math over [t, V] runs as fused kernels: one or two passes over the
# bf16 logits instead of ~10 passes over fp32 copies, which is most of the LM head's cost.
# The last chunk's length follows the step's token count: after the first two lengths torch
# compiles for any length (a graph per length would recompile in most steps).
_FUSED: dict[str, Callable[..., Any]] = {}


def _fused(name: str, fn: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    if device.type != "cuda":
        return fn
    if name not in _FUSED:
        _FUSED[name] = torch.compile(fn, dynamic=None)
    return _FUSED[name]


class _TargetLogProbs(torch.autograd.Function):
    """(hidden [T, D], weight [V, D], targets [T], inv_temp [T]) → (logprobs [T], entropy [T]).

    Both outputs are differentiable; backward pays for the entropy's gradient only when the loss
    used it (an entropy bonus), since unused outputs arrive as None (no materialised zeros).
    """

    @staticmethod
    def forward(
        ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, inv_temp: Tensor, chunk: int
    ) -> tuple[Tensor, Tensor]:
        num_tokens = hidden.shape[0]
        logprobs = hidden.new_empty(num_tokens, dtype=torch.float32)
        entropy = hidden.new_empty(num_tokens, dtype=torch.float32)
        stats = _fused("stats", _stats, hidden.device)
        for start in range(0, num_tokens, chunk):
            end = min(start + chunk, num_tokens)
            logits = hidden[start:end] @ weight.t()
            logprobs[start:end], entropy[start:end] = stats(
                logits, targets[start:end], inv_temp[start:end]
            )
        ctx.save_for_backward(hidden, weight, targets, inv_temp)
        ctx.chunk = chunk
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        hidden, weight, targets, inv_temp = ctx.saved_tensors
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(inv_temp)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if grad_entropy is None:
            grad_fn = _fused("grad", _grad_logits, hidden.device)
        else:
            grad_fn = _fused("grad_entropy", _grad_logits_with_entropy, hidden.device)
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, hidden.shape[0])
            logits = hidden[start:end] @ weight.t()
            extra = () if grad_entropy is None else (grad_entropy[start:end],)
            grad_logits = grad_fn(
                logits, targets[start:end], inv_temp[start:end], grad_logprobs[start:end], *extra
            )
            grad_hidden[start:end] = grad_logits @ weight
            # Low-precision matmul (fp32 accumulate inside), chunk partial sums added in fp32.
            grad_weight += (grad_logits.t() @ hidden[start:end]).float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None


#: `_TargetLogProbs.apply` with its types (torch leaves `Function.apply` unannotated).
_target_logprobs: Callable[[Tensor, Tensor, Tensor, Tensor, int], tuple[Tensor, Tensor]] = (
    _TargetLogProbs.apply
)


def target_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperatures: Tensor,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[Tensor, Tensor]:
    """Log π(target) and the full-distribution entropy at each position, both [T] fp32.

    hidden [T, D] (any float dtype), weight [V, D] (the LM head), targets [T] int64,
    temperatures [T] > 0. Both carry gradients (the entropy's for an entropy bonus).
    """
    chunk = chunk_size(hidden.shape[0], weight.shape[0], chunk_elements)
    inv_temp = temperatures.float().reciprocal()
    return _target_logprobs(hidden, weight, targets, inv_temp, chunk)
