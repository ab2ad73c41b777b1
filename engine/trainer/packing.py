"""Sequence packing: variable-length samples → fixed rows of `seq_len` tokens.

Packing keeps every token of a row useful instead of padding each sample to the longest one.
Three invariants make it exact rather than approximate:

- position ids restart at 0 for every sample, so RoPE sees each sample as if it were alone;
- attention never crosses samples (the row's `doc_lens` drive the document mask, see
  `engine.trainer.attention`);
- every per-token array is shifted once here into *prediction alignment*: position `i` of a row
  holds the token the model reads (`input_ids[i]`) and everything about the token it predicts
  (`targets[i]`, `loss_mask[i]`, `inference_logprobs[i]`, `advantages[i]`, `temperatures[i]`).
  The last token of a sample predicts nothing, so nothing leaks from one sample into the next.

Padding at the end of a row forms its own document (positions restart, mask false), so it
neither attends to nor is attended by real tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Sample:
    """One sequence as sampled: prompt + completion tokens and per-token arrays of the same length.

    `loss_mask[i]` says token `i` is trained on (it was sampled by the policy, or is an assistant
    token in SFT); `logprobs[i]` is its inference log-probability (0 where unknown). `advantage`,
    `temperature`, `weight` (what each of its tokens weighs in the loss: 1, or a sequence
    normalisation's share, `engine.trainer.loss.sequence_weights`) and `lag` (how many versions
    its oldest token is behind the weights that train on it: 0 on-policy and in SFT) are per
    sample; they become per-token arrays when packed.
    """

    token_ids: np.ndarray  # [n] int64
    loss_mask: np.ndarray  # [n] bool
    logprobs: np.ndarray  # [n] float32
    advantage: float = 1.0
    temperature: float = 1.0
    weight: float = 1.0
    lag: int = 0

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"per-token arrays must align: {n} token_ids, {len(self.loss_mask)} loss_mask, "
                f"{len(self.logprobs)} logprobs"
            )
        if n == 0:
            raise ValueError("a sample needs at least one token")

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class PackedRows:
    """Rows of exactly `seq_len` tokens; every array is [rows, seq_len] in prediction alignment.

    `doc_lens[r]` lists the lengths of the documents in row r in order (padding included as a
    final document), summing to `seq_len`. `sample_index[r]` names the source samples.
    """

    input_ids: np.ndarray  # [R, S] int64
    position_ids: np.ndarray  # [R, S] int64
    targets: np.ndarray  # [R, S] int64, token predicted at each position (0 where none)
    loss_mask: np.ndarray  # [R, S] bool
    inference_logprobs: np.ndarray  # [R, S] float32
    advantages: np.ndarray  # [R, S] float32
    temperatures: np.ndarray  # [R, S] float32 (1.0 on padding)
    loss_weights: np.ndarray  # [R, S] float32, each token's weight in the loss (1.0 on padding)
    lags: np.ndarray  # [R, S] int32, the sample's `lag` (0 on padding)
    doc_lens: list[list[int]] = field(default_factory=list)
    sample_index: list[list[int]] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    def real_tokens(self) -> np.ndarray:
        """[R] tokens per row that belong to samples (not padding)."""
        pairs = zip(self.doc_lens, self.sample_index, strict=True)
        return np.array([sum(lens[: len(members)]) for lens, members in pairs], dtype=np.int64)

    def select(self, rows: Sequence[int]) -> PackedRows:
        """The rows at `rows`, in that order (used to hand each rank its share)."""
        index = np.asarray(rows, dtype=np.int64)
        return PackedRows(
            input_ids=self.input_ids[index],
            position_ids=self.position_ids[index],
            targets=self.targets[index],
            loss_mask=self.loss_mask[index],
            inference_logprobs=self.inference_logprobs[index],
            advantages=self.advantages[index],
            temperatures=self.temperatures[index],
            loss_weights=self.loss_weights[index],
            lags=self.lags[index],
            doc_lens=[self.doc_lens[i] for i in rows],
            sample_index=[self.sample_index[i] for i in rows],
        )


def truncate(sample: Sample, max_len: int) -> Sample:
    """The first `max_len` tokens of `sample` (for configured truncation of over-long samples)."""
    if len(sample) <= max_len:
        return sample
    return Sample(
        token_ids=sample.token_ids[:max_len],
        loss_mask=sample.loss_mask[:max_len],
        logprobs=sample.logprobs[:max_len],
        advantage=sample.advantage,
        temperature=sample.temperature,
        weight=sample.weight,
        lag=sample.lag,
    )


def assign_rows(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """First-fit decreasing: sample indices per row, each row's total ≤ `seq_len`.

    Deterministic (ties broken by index) so that every rank, packing the same batch, computes
    the same rows. Raises `ValueError` naming the first sample longer than `seq_len`.
    """
    for index, length in enumerate(lengths):
        if length > seq_len:
            raise ValueError(
                f"sample {index} has {length} tokens, more than seq_len={seq_len}; raise seq_len "
                "or enable truncation"
            )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[int] = []
    for index in order:
        for row, space in enumerate(free):
            if lengths[index] <= space:
                rows[row].append(index)
                free[row] -= lengths[index]
                break
        else:
            rows.append([index])
            free.append(seq_len - lengths[index])
    return rows


def empty_rows(num_rows: int, seq_len: int) -> PackedRows:
    """All-padding rows: they carry no loss and keep ranks in lock-step when data runs short."""
    shape = (num_rows, seq_len)
    return PackedRows(
        input_ids=np.zeros(shape, np.int64),
        position_ids=np.tile(np.arange(seq_len, dtype=np.int64), (num_rows, 1)),
        targets=np.zeros(shape, np.int64),
        loss_mask=np.zeros(shape, np.bool_),
        inference_logprobs=np.zeros(shape, np.float32),
        advantages=np.zeros(shape, np.float32),
        temperatures=np.ones(shape, np.float32),
        loss_weights=np.ones(shape, np.float32),
        lags=np.zeros(shape, np.int32),
        doc_lens=[[seq_len] for _ in range(num_rows)],
        sample_index=[[] for _ in range(num_rows)],
    )


def pack_samples(samples: Sequence[Sample], seq_len: int) -> PackedRows:
    """Pack `samples` into rows of `seq_len` tokens (see the module docstring for the layout)."""
    assignment = assign_rows([len(s) for s in samples], seq_len)
    rows = empty_rows(len(assignment), seq_len)
    for r, members in enumerate(assignment):
        start = 0
        lens: list[int] = []
        for index in members:
            sample = samples[index]
            n = len(sample)
            end = start + n
            rows.input_ids[r, start:end] = sample.token_ids
            rows.position_ids[r, start:end] = np.arange(n)
            # Position i predicts token i+1 of the same sample; the sample's last position
            # predicts nothing, so the shift never reaches into the next sample.
            rows.targets[r, start : end - 1] = sample.token_ids[1:]
            rows.loss_mask[r, start : end - 1] = sample.loss_mask[1:]
            rows.inference_logprobs[r, start : end - 1] = sample.logprobs[1:]
            rows.advantages[r, start:end] = sample.advantage
            rows.temperatures[r, start:end] = sample.temperature
            rows.loss_weights[r, start:end] = sample.weight
            rows.lags[r, start:end] = sample.lag
            lens.append(n)
            start = end
        if start < seq_len:
            rows.position_ids[r, start:] = np.arange(seq_len - start)
            lens.append(seq_len - start)
        rows.doc_lens[r] = lens
        rows.sample_index[r] = list(members)
    return rows
