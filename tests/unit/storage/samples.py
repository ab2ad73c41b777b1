"""Valid rollout rows for tests, varied enough to exercise every column."""

from __future__ import annotations

from typing import Any


def make_row(index: int, step: int = 3, **changes: Any) -> dict[str, Any]:
    length = 3 + index % 4
    row = {
        "step": step,
        "policy_version": max(step - 1, 0),
        "policy_lineage": f"lineage-{index % 2}",
        "env": "reverse_text",
        "example_id": index // 2,
        "group_id": index // 2,
        "rollout_id": index,
        "row_index": 0,
        "rollout_rows": 1,
        "token_ids": [(index * 7 + k) % 256 for k in range(length)],
        "loss_mask": [k >= 2 for k in range(length)],
        "logprobs": [0.0 if k < 2 else -0.25 * k for k in range(length)],
        "token_versions": [-1 if k < 2 else max(step - 1, 0) for k in range(length)],
        "reward": float(index % 2),
        "advantage": 0.5 if index % 2 else -0.5,
        "temperature": 1.0,
        "is_truncated": index % 5 == 0,
        "prompt_text": f"reverse: word{index}",
        "completion_text": f"{index}drow",
        "metrics": {"reversed_similarity": 0.5 + index % 2 / 2, "format": 1.0},
    }
    row.update(changes)
    return row


def rows(count: int, step: int = 3) -> list[dict[str, Any]]:
    return [make_row(index, step) for index in range(count)]
