"""SFT data: assistant-only loss mask, row formats, file formats, env sources, seeded order."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from engine.config.sft import SftDataConfig
from engine.trainer.sft_data import (
    SftDataError,
    load_sft_dataset,
    read_rows,
    to_messages,
    to_samples,
    tokenize_conversation,
)

CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo!"},
    {"role": "user", "content": "again"},
    {"role": "assistant", "content": "ab"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def test_loss_mask_covers_assistant_turns_only(tokenizer) -> None:
    ids, mask = tokenize_conversation(tokenizer, CONVERSATION, "row 0")
    assert ids == tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    trained = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    # Content and the end-of-turn marker are trained; role headers and other turns are not.
    assert trained == "yo!<|im_end|>\nab<|im_end|>\n"
    prompt = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if not m])
    assert "assistant\n" in prompt and "yo!" not in prompt


def test_a_tool_row_renders_its_schemas_and_trains_the_calls_not_the_results(tokenizer) -> None:
    schema = {"type": "function", "function": {"name": "calc", "description": "adds"}}
    call = {"id": "c0", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}
    row = {
        "messages": [
            {"role": "user", "content": "1 + 1?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c0", "content": "2"},
            {"role": "assistant", "content": "<answer>2</answer>"},
        ],
        "tools": [schema],
    }
    (sample,) = to_samples(tokenizer, [row], "data", seq_len=4096, allow_truncation=False)
    ids, mask = sample.token_ids.tolist(), sample.loss_mask.tolist()
    prompt = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if not m])
    assert '"name": "calc"' in prompt and "<tool_response>\n2\n" in prompt
    assert tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m]) == (
        '<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call><|im_end|>\n'
        "<answer>2</answer><|im_end|>\n"
    )
    with pytest.raises(SftDataError, match="row 1: `tools` must be a list"):
        to_samples(tokenizer, [row, {**row, "tools": "calc"}], "data", 4096, allow_truncation=False)


def test_prompt_completion_rows_become_a_user_and_an_assistant_turn() -> None:
    assert to_messages({"prompt": "p", "completion": "c"}, "r") == [
        {"role": "user", "content": "p"},
        {"role": "assistant", "content": "c"},
    ]
    with pytest.raises(SftDataError, match="r: needs `messages` or `prompt` \\+ `completion`"):
        to_messages({"text": "x"}, "r")
    with pytest.raises(SftDataError, match="no assistant message"):
        to_messages({"messages": [{"role": "user", "content": "x"}]}, "r")


def test_a_template_that_rewrites_history_is_reported(tokenizer) -> None:
    rewriting = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    # Renders only the last message: earlier turns vanish as the conversation grows.
    rewriting.chat_template = (
        "{{ messages[-1]['role'] + ':' + messages[-1]['content'] }}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    with pytest.raises(SftDataError, match="earlier tokens change"):
        tokenize_conversation(rewriting, CONVERSATION, "row 3")


def test_rows_tokenised_in_batches_match_the_template_one_by_one(tokenizer) -> None:
    """Batched rendering and encoding (chunks of 2 over 5 rows of different shapes) gives each
    row the ids `apply_chat_template` gives it alone, and errors name the row's own index."""
    batch = [
        {"messages": CONVERSATION},
        {"prompt": "p", "completion": "c"},
        {"messages": [*CONVERSATION[:3], {"role": "user", "content": "thanks"}]},
        {"prompt": [{"role": "user", "content": "x" * 40}], "completion": "y" * 40},
        {"messages": CONVERSATION[1:3]},
    ]
    samples = to_samples(tokenizer, batch, "data", seq_len=4096, allow_truncation=False, chunk=2)
    for row, sample in zip(batch, samples, strict=True):
        messages = to_messages(row, "r")
        assert sample.token_ids.tolist() == tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=False
        )
        trained = tokenizer.decode(sample.token_ids[sample.loss_mask].tolist())
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        assert trained == "".join(f"{reply}<|im_end|>\n" for reply in replies)
    with pytest.raises(SftDataError, match=r"^data row 3: 101 tokens exceed seq_len=100"):
        to_samples(tokenizer, batch, "data", seq_len=100, allow_truncation=False, chunk=2)


def rows(n: int) -> list[dict]:
    return [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(n)]


def test_jsonl_parquet_and_arrow_read_the_same_rows(tmp_path: Path) -> None:
    data = rows(5)
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in data) + "\n")
    table = pa.Table.from_pylist(data)
    pq.write_table(table, tmp_path / "d.parquet")
    with ipc.new_file(str(tmp_path / "d.arrow"), table.schema) as writer:
        writer.write_table(table)
    for name in ("d.jsonl", "d.parquet", "d.arrow"):
        assert read_rows(str(tmp_path / name)) == data
    assert read_rows(f"file://{tmp_path}/d.jsonl") == data


def generated(num_examples: int, seed: int, prefix: str = "x") -> list[dict]:
    """An SFT source as an environment would provide it."""
    rng = np.random.default_rng(seed)
    return [
        {"prompt": f"{prefix}{int(v)}", "completion": str(int(v))[::-1]}
        for v in rng.integers(100, 999, num_examples)
    ]


def test_env_source_split_and_seeded_epochs(tokenizer) -> None:
    config = SftDataConfig(
        env="tests.unit.trainer.test_sft_data:generated",
        env_args={"prefix": "n"},
        num_examples=40,
        eval_fraction=0.1,
    )
    data = load_sft_dataset(config, tokenizer, seq_len=64, seed=3, allow_truncation=False)
    assert (len(data.train), len(data.eval)) == (36, 4)
    # Each epoch is a permutation; epochs differ; the order depends only on (seed, epoch).
    first = data.order(0)
    assert sorted(first.tolist()) == list(range(36))
    assert first.tolist() != data.order(1).tolist()
    again = load_sft_dataset(config, tokenizer, seq_len=64, seed=3, allow_truncation=False)
    assert [s.token_ids.tolist() for s in data.batch(30, 12)] == [
        s.token_ids.tolist() for s in again.batch(30, 12)
    ]


def test_missing_env_and_long_rows_are_clear_errors(tokenizer, tmp_path: Path) -> None:
    with pytest.raises(SftDataError, match=r"cannot import 'engine\.envs\.no_such_env'"):
        load_sft_dataset(
            SftDataConfig(env="no-such-env"), tokenizer, seq_len=64, seed=0, allow_truncation=False
        )
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "p" * 100, "completion": "c"}) + "\n")
    config = SftDataConfig(path=str(path), eval_fraction=0.0)
    with pytest.raises(SftDataError, match=r"long\.jsonl row 0: .* exceed seq_len=64"):
        load_sft_dataset(config, tokenizer, seq_len=64, seed=0, allow_truncation=False)
    data = load_sft_dataset(config, tokenizer, seq_len=64, seed=0, allow_truncation=True)
    assert len(data.train[0]) == 64


def test_the_built_in_alphabet_sort_source_trains_every_assistant_turn(tokenizer) -> None:
    config = SftDataConfig(env="alphabet-sort", env_args={"num_turns": 2}, num_examples=20)
    data = load_sft_dataset(config, tokenizer, seq_len=512, seed=0, allow_truncation=False)
    sample = data.train[0]
    trained = tokenizer.decode(sample.token_ids[sample.loss_mask].tolist())
    assert trained.count("<sorted>") == 2 and trained.count("<|im_end|>") == 2
    assert "Sort these names" not in trained
