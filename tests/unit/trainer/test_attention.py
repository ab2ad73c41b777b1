"""No cross-sample attention: a packed row gives each sample exactly its unpacked output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engine.trainer.attention import document_kwargs
from engine.trainer.model import ModelOptions, PolicyModel, load_causal_lm
from engine.trainer.packing import Sample, pack_samples


def test_packed_rows_equal_unpacked_samples(tiny_model_dir: Path) -> None:
    causal_lm = load_causal_lm(str(tiny_model_dir), ModelOptions())
    policy = PolicyModel(causal_lm).eval()
    rng = np.random.default_rng(0)
    vocab = causal_lm.config.vocab_size
    samples = [
        Sample(
            token_ids=rng.integers(0, vocab, n),
            loss_mask=np.ones(n, bool),
            logprobs=np.zeros(n, np.float32),
            temperature=float(temp),
        )
        for n, temp in [(11, 1.0), (7, 0.7), (14, 1.3), (5, 1.0), (9, 2.0)]
    ]
    rows = pack_samples(samples, seq_len=24)
    assert rows.num_rows == 2 and max(len(r) for r in rows.sample_index) >= 2

    def t(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array)

    with torch.no_grad():
        packed, entropy = policy(
            t(rows.input_ids),
            t(rows.position_ids),
            t(rows.targets),
            t(rows.temperatures),
            **document_kwargs(rows.doc_lens, rows.seq_len, torch.device("cpu"), varlen=False),
        )
        for r, members in enumerate(rows.sample_index):
            start = 0
            for index in members:
                sample = samples[index]
                n = len(sample)
                ids = t(sample.token_ids)[None]
                alone, _ = policy(
                    ids,
                    torch.arange(n)[None],
                    torch.cat([ids[:, 1:], torch.zeros(1, 1, dtype=ids.dtype)], 1),
                    torch.full((1, n), sample.temperature),
                )
                # Stock transformers, full logits: log-softmax(logits / τ) of the next token.
                logits = causal_lm(ids).logits[0, :-1] / sample.temperature
                stock = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None]).squeeze(1)
                offset = r * rows.seq_len + start
                got = packed[offset : offset + n - 1]
                torch.testing.assert_close(got, alone[: n - 1], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(got, stock, atol=1e-5, rtol=1e-5)
                start += n
    assert torch.isfinite(entropy).all()
