"""Turns and trajectories: exact prompt tokens, verbatim history, split where history changes."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from engine.config.orchestrator import SamplingConfig
from engine.envs import (
    ChatTokenizer,
    PromptTooLongError,
    SamplerFailedError,
    Turn,
    TurnGenerator,
    assemble,
)
from engine.models.char_tokenizer import write_tokenizer
from tests.unit.envs.conftest import last_user_text

SAMPLING = SamplingConfig(max_tokens=64)


def conversation(generator: TurnGenerator, replies: int) -> tuple[list[Turn], list[dict]]:
    """`replies` turns of a chat where the user keeps sending a new number."""

    async def run() -> tuple[list[Turn], list[dict]]:
        messages = [{"role": "system", "content": "Echo."}, {"role": "user", "content": "one"}]
        turns: list[Turn] = []
        for index in range(replies):
            turn = await generator.generate(
                messages, SAMPLING, previous=turns[-1] if turns else None
            )
            turns.append(turn)
            messages += [
                {"role": "assistant", "content": turn.text},
                {"role": "user", "content": f"n{index}"},
            ]
        return turns, messages

    return asyncio.run(run())


def test_first_turn_prompt_is_the_chat_template_tokenised_once(
    hf_tokenizer: Any, policy: Any, generator: Any
) -> None:
    sampler = policy(lambda prompt: "echo " + last_user_text(prompt))
    (turn,), _ = conversation(generator(sampler), 1)
    rendered = hf_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Echo."}, {"role": "user", "content": "one"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert list(turn.prompt_ids) == hf_tokenizer.encode(rendered, add_special_tokens=False)
    assert sampler.requests[0][0] == list(turn.prompt_ids)
    assert turn.text == "echo one" and turn.prompt_text == rendered


def test_later_turns_keep_earlier_tokens_verbatim_and_mask_only_sampled_tokens(
    hf_tokenizer: Any, policy: Any, generator: Any
) -> None:
    turns, messages = conversation(generator(policy(lambda p: "got " + last_user_text(p))), 3)
    for before, after in itertools.pairwise(turns):
        history = [*before.prompt_ids, *before.completion_ids]
        assert list(after.prompt_ids[: len(history)]) == history
    (sequence,) = assemble(turns)
    assert sequence.num_turns == 3
    # The trajectory decodes to the whole conversation as the template renders it.
    full = hf_tokenizer.apply_chat_template(messages[:-1], tokenize=False)
    assert hf_tokenizer.decode(sequence.token_ids) + "\n" == full
    sampled = [t for t, m in zip(sequence.token_ids, sequence.loss_mask, strict=True) if m]
    assert sampled == [token for turn in turns for token in turn.completion_ids]
    assert all(
        (lp != 0.0) == mask for lp, mask in zip(sequence.logprobs, sequence.loss_mask, strict=True)
    )
    assert sequence.prompt_len == len(turns[0].prompt_ids)


def test_sampled_special_tokens_and_other_stop_tokens_stay_verbatim(
    hf_tokenizer: Any, policy: Any, generator: Any
) -> None:
    # The text the environment sees drops `<|im_start|>`, and the turn ends on `<|endoftext|>`
    # rather than the template's `<|im_end|>`: the next prompt still holds the sampled ids.
    sampler = policy(lambda prompt: "a<|im_start|>b", stop_token="<|endoftext|>")
    turns, messages = conversation(generator(sampler), 2)
    assert turns[0].text == "ab"
    (sequence,) = assemble(turns)
    text = hf_tokenizer.decode(sequence.token_ids)
    first = hf_tokenizer.apply_chat_template(
        messages[:2], add_generation_prompt=True, tokenize=False
    )
    assert text.startswith(first + "a<|im_start|>b<|endoftext|><|im_end|>\n<|im_start|>user\nn0")
    assert sum(sequence.loss_mask) == sum(len(turn.completion_ids) for turn in turns)


def test_a_template_that_rewrites_history_splits_the_trajectory(
    tmp_path: Path, policy: Any
) -> None:
    write_tokenizer(tmp_path, model_max_length=4096)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    # Like reasoning templates that strip earlier thoughts: older assistant turns render blank.
    tokenizer.chat_template = (
        "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{%- if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}"
        "{{ '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    sampler = policy(lambda prompt: "reply")
    turns, _ = conversation(TurnGenerator(sampler, ChatTokenizer(tokenizer), 1024), 3)
    sequences = assemble(turns)
    assert [s.num_turns for s in sequences] == [1, 1, 1]
    for turn, sequence in zip(turns, sequences, strict=True):
        assert sequence.token_ids == [*turn.prompt_ids, *turn.completion_ids]
        assert sum(sequence.loss_mask) == len(turn.completion_ids)


def test_a_prompt_that_fills_the_context_is_refused_and_max_tokens_fits_the_room(
    policy: Any, generator: Any
) -> None:
    sampler = policy(lambda prompt: "x" * 100)
    prompt_len = len(conversation(generator(policy(lambda p: "")), 1)[0][0].prompt_ids)
    with pytest.raises(PromptTooLongError):
        conversation(generator(sampler, max_seq_len=prompt_len), 1)
    (turn,), _ = conversation(generator(sampler, max_seq_len=prompt_len + 10), 1)
    assert sampler.requests[-1][1].max_tokens == 10
    assert len(turn.completion_ids) == 10 and turn.is_truncated
    (sequence,) = assemble([turn])
    assert sequence.is_truncated and len(sequence.token_ids) == prompt_len + 10


def test_a_failing_sampler_is_reported_as_such(generator: Any) -> None:
    class Down:
        async def generate(self, *args: Any, **kwargs: Any) -> list[Any]:
            raise ConnectionError("server gone")

    with pytest.raises(SamplerFailedError, match="server gone"):
        conversation(generator(Down()), 1)


def test_policy_version_and_lineage_of_a_sequence_are_its_oldest_turns(
    policy: Any, generator: Any
) -> None:
    sampler = policy(lambda prompt: "hi")
    gen = generator(sampler)

    async def run() -> list[Turn]:
        messages = [{"role": "user", "content": "a"}]
        sampler.policy_version, sampler.policy_lineage = 5, "dead"
        first = await gen.generate(messages, SAMPLING)
        sampler.policy_version, sampler.policy_lineage = 7, "resumed"
        messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "b"}]
        return [first, await gen.generate(messages, SAMPLING, previous=first)]

    (sequence,) = assemble(asyncio.run(run()))
    assert sequence.policy_version == 5
    assert sequence.policy_lineage == "dead"  # the oldest turn's, with its version


def test_turns_with_misaligned_logprobs_are_rejected() -> None:
    turn = Turn((1, 2), (3, 4), (-0.1,), 0, "stop", "")
    with pytest.raises(ValueError, match="2 sampled tokens but 1 log-probs"):
        assemble([turn])
