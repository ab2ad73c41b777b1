"""Chunked LM-head log-probs: same values and gradients as the plain full-logits computation."""

from __future__ import annotations

import torch

from engine.trainer.logprobs import chunk_size, target_logprobs


def reference(hidden, weight, targets, temperatures):
    logits = (hidden @ weight.t()) / temperatures[:, None]
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(1, targets[:, None]).squeeze(1), entropy


def random_inputs(seed: int, t: int, d: int, v: int) -> tuple[torch.Tensor, ...]:
    """hidden [t, d] and head weight [v, d] (both with grad), targets [t], temperatures [t]."""
    torch.manual_seed(seed)
    hidden = torch.randn(t, d, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, d, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (t,))
    temperatures = torch.rand(t, dtype=torch.float64) + 0.5
    return hidden, weight, targets, temperatures


def test_values_and_gradients_match_full_logits_across_chunks() -> None:
    t, v = 37, 50
    hidden, weight, targets, temperatures = random_inputs(0, t, 8, v)
    upstream = torch.randn(t, dtype=torch.float64)

    # 200 elements per chunk → 4 tokens per chunk → 10 chunks, the last one partial.
    assert chunk_size(t, v, 200) == 4
    logp, entropy = target_logprobs(hidden, weight, targets, temperatures, chunk_elements=200)
    (logp * upstream).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    ref_logp, ref_entropy = reference(hidden, weight, targets, temperatures)
    (ref_logp * upstream).sum().backward()
    # The function computes in fp32 internally: fp32 tolerances.
    torch.testing.assert_close(logp.double(), ref_logp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[0], hidden.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[1], weight.grad, atol=1e-5, rtol=1e-5)


def test_the_entropy_gradient_matches_full_logits() -> None:
    """An entropy bonus back-propagates through the chunked entropy as through plain logits."""
    t = 23
    hidden, weight, targets, temperatures = random_inputs(1, t, 8, 40)
    up_logp, up_entropy = torch.randn(t, dtype=torch.float64), torch.randn(t, dtype=torch.float64)

    for use_logp in (True, False):  # with the log-probs' gradient, and the entropy's alone
        logp, entropy = target_logprobs(hidden, weight, targets, temperatures, chunk_elements=120)
        ((logp * up_logp).sum() * use_logp + (entropy * up_entropy).sum()).backward()
        grads = hidden.grad.clone(), weight.grad.clone()
        hidden.grad = weight.grad = None
        ref_logp, ref_entropy = reference(hidden, weight, targets, temperatures)
        ((ref_logp * up_logp).sum() * use_logp + (ref_entropy * up_entropy).sum()).backward()
        torch.testing.assert_close(grads[0], hidden.grad, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grads[1], weight.grad, atol=1e-5, rtol=1e-5)
        hidden.grad = weight.grad = None
