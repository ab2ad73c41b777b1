"""Test data for storage: rollout tables of any size, and a tiny Qwen3 model, both built offline.

The tables are built column-wise with numpy so that the benchmark's 256 MB of 4096-token rows
takes a second, not minutes; the values are seeded so every run writes the same bytes.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from storage.shards import ROLLOUT_SCHEMA

# Real vocabularies are ~150k tokens: ids that wide compress the way real rollouts do.
VOCAB = 151_936
PROMPT_TOKENS = 64
ZIPF_A = 1.2


def rollout_table(rows: int, *, step: int, seq_len: int = 64, seed: int = 0) -> pa.Table:
    """`rows` valid rollout rows of exactly `seq_len` tokens each, in `ROLLOUT_SCHEMA`."""
    rng = np.random.default_rng(seed)
    tokens = rows * seq_len
    offsets = pa.array(np.arange(0, tokens + 1, seq_len, dtype=np.int32))
    # Zipf-distributed ids repeat the way text does, so LZ4 has real work (about 20% smaller,
    # like real rollouts); uniform ids would be stored uncompressed and flatter the reader.
    token_ids = (rng.zipf(ZIPF_A, size=tokens) % VOCAB).astype(np.int32)
    position = np.tile(np.arange(seq_len), rows)
    loss_mask = position >= min(PROMPT_TOKENS, seq_len // 2)
    logprobs = np.where(loss_mask, -rng.exponential(0.5, size=tokens), 0.0).astype(np.float32)
    index = np.arange(rows, dtype=np.int64)
    reward = (index % 2).astype(np.float32)
    metric_keys = pa.array(["reversed_similarity", "format"] * rows)
    metric_values = pa.array(np.tile(np.array([0.5, 1.0], dtype=np.float32), rows))
    metric_offsets = pa.array(np.arange(0, 2 * rows + 1, 2, dtype=np.int32))
    columns = {
        "step": pa.array(np.full(rows, step, dtype=np.int64)),
        "policy_version": pa.array(np.full(rows, max(step - 1, 0), dtype=np.int64)),
        "policy_lineage": pa.array(["lineage-0"] * rows),
        "env": pa.array(["reverse_text"] * rows),
        "example_id": pa.array(index // 4),
        "group_id": pa.array(index // 4),
        "rollout_id": pa.array(index),
        "row_index": pa.array(np.zeros(rows, dtype=np.int32)),
        "rollout_rows": pa.array(np.ones(rows, dtype=np.int32)),
        "token_ids": pa.ListArray.from_arrays(offsets, pa.array(token_ids)),
        "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(loss_mask)),
        "logprobs": pa.ListArray.from_arrays(offsets, pa.array(logprobs)),
        "token_versions": pa.ListArray.from_arrays(
            offsets, pa.array(np.where(loss_mask, max(step - 1, 0), -1).astype(np.int32))
        ),
        "reward": pa.array(reward),
        "advantage": pa.array(reward - 0.5),
        "temperature": pa.array(np.ones(rows, dtype=np.float32)),
        "is_truncated": pa.array(index % 7 == 0),
        "prompt_text": pa.array([f"reverse: word{i}" for i in range(rows)]),
        "completion_text": pa.array([f"{i}drow" for i in range(rows)]),
        "metrics": pa.MapArray.from_arrays(metric_offsets, metric_keys, metric_values),
    }
    return pa.Table.from_arrays(
        [columns[field.name] for field in ROLLOUT_SCHEMA], schema=ROLLOUT_SCHEMA
    )


def tiny_qwen3(seed: int = 0):  # -> transformers Qwen3ForCausalLM
    """A two-layer Qwen3 with random weights, built from a config: no download, ~100k params."""
    import torch
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()
