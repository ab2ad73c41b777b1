"""SFT data: chat rows → token ids with a loss mask on assistant tokens only.

Rows are `{"messages": [{"role", "content"}, ...]}` or `{"prompt", "completion"}` (each a string
or a list of messages), with an optional `tools` list of function schemas (OpenAI's format) that
the chat template renders as RL's tool environments render it, so a tool-calling demonstration
is trained on the prompt the policy will see. Assistant turns may carry `tool_calls`, and `tool`
messages the results (masked, as environment text is in RL). They come from JSONL, Parquet or
Arrow files (local paths or object-store URIs), from a Hugging Face dataset by name (where the
`datasets` package and a hub are available), or from an environment that generates them.

**Environment sources.** An SFT source is any `Iterable[dict]` of rows as above. `data.env`
names one: `"package.module:function"`, or a built-in id such as `reverse-text`, which resolves
to `engine.envs.reverse_text:sft_examples`. The function is called as
`fn(num_examples=..., seed=..., **env_args)`.

**Assistant mask.** Each assistant turn's tokens are found by rendering the conversation with
the model's chat template up to that turn twice — before it (with the generation prompt) and
after it — and taking the difference: the role header is prompt, the content and the template's
end-of-turn tokens are trained. This needs a template whose rendering of a prefix is a prefix of
the whole; one that rewrites earlier turns (e.g. strips reasoning) is reported, not trained on.
"""

from __future__ import annotations

import importlib
import io
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
from transformers import PreTrainedTokenizerBase

from engine.config.sft import SftDataConfig
from engine.trainer.packing import Sample, truncate
from storage.store import ObjectStore

Message = Mapping[str, Any]
SftSource = Callable[..., Iterable[Mapping[str, Any]]]


class SftDataError(ValueError):
    """An SFT row or file that cannot be trained on; the message names where it came from."""


def to_messages(row: Mapping[str, Any], where: str) -> list[Message]:
    """A row's conversation, from `messages` or from `prompt` + `completion`."""
    if "messages" in row:
        messages = list(row["messages"])
    elif "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        messages = [
            *([{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt),
            *(
                [{"role": "assistant", "content": completion}]
                if isinstance(completion, str)
                else completion
            ),
        ]
    else:
        raise SftDataError(f"{where}: needs `messages` or `prompt` + `completion`; has {list(row)}")
    if not any(m.get("role") == "assistant" for m in messages):
        raise SftDataError(f"{where}: no assistant message, so nothing to train on")
    return messages


def _render_points(messages: Sequence[Message]) -> list[tuple[int, bool]]:
    """The renders that bound the assistant turns, as (prefix length, generation prompt): each
    assistant turn before (with its role header) and after; then the whole conversation when
    turns follow the last assistant one. Other turns need no render of their own."""
    points: list[tuple[int, bool]] = []
    for index, message in enumerate(messages):
        if message.get("role") == "assistant":
            points += [(index, True), (index + 1, False)]
    if not points or points[-1][0] != len(messages):
        points.append((len(messages), False))
    return points


def _render_text(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    gen: bool,
    tools: Sequence[Mapping[str, Any]] | None,
) -> str:
    if not messages:
        return ""
    text = tokenizer.apply_chat_template(
        [dict(message) for message in messages],
        tools=[dict(tool) for tool in tools] if tools else None,
        tokenize=False,
        add_generation_prompt=gen,
    )
    return cast(str, text)


#: One conversation to tokenise: its messages, its tool schemas (or None), and where it came from.
Conversation = tuple[Sequence[Message], Sequence[Mapping[str, Any]] | None, str]


def tokenize_conversations(
    tokenizer: PreTrainedTokenizerBase, conversations: Sequence[Conversation]
) -> list[tuple[list[int], list[bool]]]:
    """Each conversation's token ids and a mask true exactly on assistant tokens.

    The chat template renders text and the tokenizer encodes every render of every conversation
    in one batched call, as `apply_chat_template(tokenize=True)` encodes one: the same ids,
    in ~1/3 of its time on 20,000 rows (`load_sft_dataset` runs before a trainer's first step).
    """
    plans = [_render_points(messages) for messages, _, _ in conversations]
    texts = [
        _render_text(tokenizer, messages[:length], gen, tools)
        for (messages, tools, _), points in zip(conversations, plans, strict=True)
        for length, gen in points
    ]
    encoded = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
    results = []
    for (messages, _, where), points in zip(conversations, plans, strict=True):
        ids: list[int] = []
        mask: list[bool] = []
        for length, gen in points:
            rendered = list(next(encoded))
            if rendered[: len(ids)] != ids:
                raise SftDataError(
                    f"{where}: the chat template renders turn {length if gen else length - 1} "
                    "so that earlier tokens change; the assistant mask cannot be derived"
                )
            # An assistant turn's role header (the generation prompt) is prompt, not target.
            trained = not gen and length > 0 and messages[length - 1].get("role") == "assistant"
            mask.extend([trained] * (len(rendered) - len(ids)))
            ids = rendered
        results.append((ids, mask))
    return results


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    where: str,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[list[int], list[bool]]:
    """One conversation's token ids and assistant mask (`tokenize_conversations`)."""
    (result,) = tokenize_conversations(tokenizer, [(messages, tools, where)])
    return result


def _conversation(row: Mapping[str, Any], where: str) -> Conversation:
    tools = row.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise SftDataError(f"{where}: `tools` must be a list of function schemas")
    return to_messages(row, where), tools, where


def _sample(
    ids: list[int], mask: list[bool], where: str, seq_len: int, allow_truncation: bool
) -> Sample:
    """Token ids and mask → a `Sample` (advantage 1, temperature 1: the loss is plain NLL)."""
    if len(ids) > seq_len and not allow_truncation:
        raise SftDataError(
            f"{where}: {len(ids)} tokens exceed seq_len={seq_len}; raise seq_len or set "
            "trainer.truncate = true"
        )
    sample = Sample(
        token_ids=np.asarray(ids, dtype=np.int64),
        loss_mask=np.asarray(mask, dtype=np.bool_),
        logprobs=np.zeros(len(ids), dtype=np.float32),
    )
    return truncate(sample, seq_len)


def to_samples(
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[Mapping[str, Any]],
    origin: str,
    seq_len: int,
    allow_truncation: bool,
    chunk: int = 4096,
) -> list[Sample]:
    """SFT rows → `Sample`s, tokenised `chunk` rows per batched call (`tokenize_conversations`)."""
    samples: list[Sample] = []
    for start in range(0, len(rows), chunk):
        conversations = [
            _conversation(row, f"{origin} row {start + i}")
            for i, row in enumerate(rows[start : start + chunk])
        ]
        tokenized = tokenize_conversations(tokenizer, conversations)
        samples += [
            _sample(ids, mask, where, seq_len, allow_truncation)
            for (ids, mask), (_, _, where) in zip(tokenized, conversations, strict=True)
        ]
    return samples


def _read_bytes(path: str) -> bytes:
    """A local file or an object-store URI (`s3://`, `gs://`, `memory://`, `file://`).

    A missing one is an `SftDataError` naming the setting, not Python's `[Errno 2]` line.
    """
    try:
        if "://" not in path:
            return Path(path).read_bytes()
        parent, _, name = path.rstrip("/").rpartition("/")
        return ObjectStore(parent).read_bytes(name)
    except FileNotFoundError:
        raise SftDataError(f"sft.data.path = {path}: no such file") from None


def read_rows(path: str) -> list[dict[str, Any]]:
    """Rows of a JSONL, Parquet or Arrow (IPC file or stream) file, or of a hub dataset."""
    lower = path.lower()
    if lower.endswith((".jsonl", ".json")):
        text = _read_bytes(path).decode("utf-8")
        rows: list[dict[str, Any]] = []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise SftDataError(f"{path}:{number}: not JSON: {exc}") from None
        return rows
    if lower.endswith(".parquet"):
        table = pq.read_table(io.BytesIO(_read_bytes(path)))
    elif lower.endswith((".arrow", ".feather", ".ipc")):
        data = pa.py_buffer(_read_bytes(path))
        try:
            table = ipc.open_file(data).read_all()
        except pa.ArrowInvalid:
            table = ipc.open_stream(data).read_all()
    else:
        return _hub_rows(path)
    return cast(list[dict[str, Any]], table.to_pylist())  # a table's rows: one dict each


def _hub_rows(name: str) -> list[dict[str, Any]]:
    try:
        datasets = importlib.import_module("datasets")
    except ImportError:
        raise SftDataError(
            f"{name!r} is not a .jsonl/.parquet/.arrow file, and loading it as a Hugging Face "
            "dataset needs the `datasets` package"
        ) from None
    return list(datasets.load_dataset(name, split="train"))


def resolve_source(env: str) -> SftSource:
    """The SFT source named by `data.env` (see the module docstring)."""
    target = env if ":" in env else f"engine.envs.{env.replace('-', '_')}:sft_examples"
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SftDataError(
            f"sft.data.env = {env!r}: cannot import {module_name!r} ({exc}); built-in "
            "environments provide `sft_examples(num_examples, seed, **args)`"
        ) from None
    source = getattr(module, attribute, None)
    if not callable(source):
        raise SftDataError(f"sft.data.env = {env!r}: {target!r} is not a function")
    return cast(SftSource, source)


@dataclass(frozen=True)
class SftDataset:
    """Tokenised train and held-out eval samples, and the order in which train samples are seen."""

    train: list[Sample]
    eval: list[Sample]
    seed: int
    shuffle: bool

    def order(self, epoch: int) -> np.ndarray:
        """Sample indices of `epoch`: a permutation seeded by (seed, epoch), so a resumed run
        recomputes the same order from its data position alone."""
        if not self.shuffle:
            return np.arange(len(self.train))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.train))

    def batch(self, position: int, size: int) -> list[Sample]:
        """`size` samples starting at global position `position` (crossing epochs as needed)."""
        count = len(self.train)
        orders: dict[int, np.ndarray] = {}
        picks = []
        for p in range(position, position + size):
            epoch, offset = divmod(p, count)
            if epoch not in orders:
                orders[epoch] = self.order(epoch)
            picks.append(self.train[int(orders[epoch][offset])])
        return picks


def _rows(config: SftDataConfig, seed: int) -> tuple[Sequence[Mapping[str, Any]], str]:
    if config.path is not None:
        return read_rows(config.path), config.path
    if config.env is None:
        raise SftDataError("sft.data: set `path` (a file or dataset) or `env` (a data source)")
    source = resolve_source(config.env)
    rows = list(source(num_examples=config.num_examples, seed=seed, **config.env_args))
    return rows, f"env {config.env}"


def load_sft_dataset(
    config: SftDataConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seq_len: int,
    seed: int,
    allow_truncation: bool,
) -> SftDataset:
    """Read, tokenise and split the SFT data; the held-out split is fixed by the seed."""
    rows, origin = _rows(config, seed)
    if not rows:
        raise SftDataError(f"{origin}: no rows")
    samples = to_samples(tokenizer, rows, origin, seq_len, allow_truncation)
    order = np.random.default_rng([seed, 2**31 - 1]).permutation(len(samples))
    num_eval = round(config.eval_fraction * len(samples))
    if num_eval >= len(samples):
        raise SftDataError(f"{origin}: eval_fraction leaves no training rows")
    eval_index, train_index = order[:num_eval], order[num_eval:]
    return SftDataset(
        train=[samples[i] for i in sorted(train_index)],
        eval=[samples[i] for i in sorted(eval_index)],
        seed=seed,
        shuffle=config.shuffle,
    )


def iter_batches(samples: Sequence[Sample], size: int) -> Iterator[list[Sample]]:
    """Consecutive batches of `size` samples (the last may be smaller), for evaluation."""
    for start in range(0, len(samples), size):
        yield list(samples[start : start + size])
