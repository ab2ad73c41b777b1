"""Packing invariants: rows never exceed seq_len, arrays align, nothing crosses samples."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.trainer.batching import balance_rows, micro_batches, rank_share, rows_per_rank
from engine.trainer.packing import Sample, assign_rows, pack_samples, truncate


def make_sample(
    n: int,
    seed: int,
    advantage: float = 1.0,
    temperature: float = 1.0,
    weight: float = 1.0,
    lag: int = 0,
) -> Sample:
    rng = np.random.default_rng(seed)
    return Sample(
        token_ids=rng.integers(1, 50, n),
        loss_mask=rng.random(n) < 0.6,
        logprobs=-rng.random(n).astype(np.float32),
        advantage=advantage,
        temperature=temperature,
        weight=weight,
        lag=lag,
    )


lengths_strategy = st.lists(st.integers(1, 32), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_strategy, seq_len=st.integers(32, 80))
def test_every_sample_lands_once_and_rows_fit(lengths: list[int], seq_len: int) -> None:
    samples = [
        make_sample(n, i, advantage=float(i), temperature=0.5 + i, weight=1.0 / n, lag=i % 3)
        for i, n in enumerate(lengths)
    ]
    rows = pack_samples(samples, seq_len)
    placed = sorted(i for members in rows.sample_index for i in members)
    assert placed == list(range(len(samples)))
    for r in range(rows.num_rows):
        assert sum(rows.doc_lens[r]) == seq_len
        assert rows.real_tokens()[r] <= seq_len
        start = 0
        for k, index in enumerate(rows.sample_index[r]):
            sample, n = samples[index], len(samples[index])
            assert rows.doc_lens[r][k] == n
            span = slice(start, start + n)
            np.testing.assert_array_equal(rows.input_ids[r, span], sample.token_ids)
            np.testing.assert_array_equal(rows.position_ids[r, span], np.arange(n))
            # Prediction alignment: position i carries the target i+1 of the same sample.
            np.testing.assert_array_equal(
                rows.targets[r, start : start + n - 1], sample.token_ids[1:]
            )
            np.testing.assert_array_equal(
                rows.loss_mask[r, start : start + n - 1], sample.loss_mask[1:]
            )
            np.testing.assert_array_equal(
                rows.inference_logprobs[r, start : start + n - 1], sample.logprobs[1:]
            )
            assert not rows.loss_mask[r, start + n - 1], "a sample's last token predicts nothing"
            assert (rows.advantages[r, span] == sample.advantage).all()
            assert (rows.temperatures[r, span] == sample.temperature).all()
            assert (rows.loss_weights[r, span] == np.float32(sample.weight)).all()
            assert (rows.lags[r, span] == sample.lag).all()
            start += n
        # Padding: its own document, no loss, positions restart.
        assert not rows.loss_mask[r, start:].any() and not rows.lags[r, start:].any()
        np.testing.assert_array_equal(rows.position_ids[r, start:], np.arange(seq_len - start))
    # Loss tokens are preserved exactly by packing.
    assert rows.loss_mask.sum() == sum(int(s.loss_mask[1:].sum()) for s in samples)


def test_first_fit_decreasing_fills_rows() -> None:
    assert assign_rows([6, 4, 4, 2], 8) == [[0, 3], [1, 2]]


def test_too_long_sample_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="sample 1 has 9 tokens, more than seq_len=8"):
        pack_samples([make_sample(3, 0), make_sample(9, 1)], 8)
    assert len(truncate(make_sample(9, 1), 8)) == 8


def test_sample_arrays_must_align() -> None:
    with pytest.raises(ValueError, match="per-token arrays must align"):
        Sample(np.arange(3), np.ones(2, bool), np.zeros(3, np.float32))


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 100), min_size=1, max_size=30),
    world=st.integers(1, 4),
    per_micro=st.integers(1, 3),
)
def test_rank_balancing_is_a_partition_with_equal_counts(
    tokens: list[int], world: int, per_micro: int
) -> None:
    capacity = rows_per_rank(len(tokens), world, per_micro)
    assert capacity % per_micro == 0
    assigned = balance_rows(tokens, world, capacity)
    assert sorted(i for rank in assigned for i in rank) == list(range(len(tokens)))
    assert all(len(rank) <= capacity for rank in assigned)
    loads = [sum(tokens[i] for i in rank) for rank in assigned]
    # LPT bound: no rank exceeds the mean by more than the largest single row.
    assert max(loads) <= sum(tokens) / world + max(tokens)


def test_rank_share_pads_with_empty_rows_and_splits_micro_batches() -> None:
    rows = pack_samples([make_sample(n, i) for i, n in enumerate([7, 6, 5, 3, 2])], 8)
    shares = [rank_share(rows, rank, 2, per_micro=2) for rank in range(2)]
    assert [s.num_rows for s in shares] == [2, 2]
    assert sum(int(s.loss_mask.sum()) for s in shares) == int(rows.loss_mask.sum())
    batches = micro_batches(shares[0], 1)
    assert [b.num_rows for b in batches] == [1, 1]
