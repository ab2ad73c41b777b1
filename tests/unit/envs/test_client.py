"""The verifiers client bridge: chat messages, Hermes tool calls, and a tool environment."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import verifiers as vf
from datasets import Dataset
from transformers import AutoTokenizer

from engine.config.orchestrator import SamplingConfig
from engine.envs import ChatTokenizer, TurnGenerator, assemble
from engine.envs.classic import ClassicEnvironment
from engine.envs.client import parse_tool_calls, to_chat_message
from engine.models.char_tokenizer import write_tokenizer

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
#: ChatML that renders assistant tool calls the way Hermes-style models write them.
TOOL_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
    "{%- for c in m.get('tool_calls') or [] %}"
    '{{ \'<tool_call>{"name": "\' + c.function.name + \'", "arguments": \' }}'
    "{{ c.function.arguments + '}</tool_call>' }}{%- endfor %}"
    "{{ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_hermes_tool_calls_are_parsed_and_malformed_ones_stay_text() -> None:
    assert parse_tool_calls("plain") == ("plain", [])
    text, calls = parse_tool_calls("Let me add." + CALL)
    assert text == "Let me add."
    assert calls == [{"id": "call_0", "name": "add", "arguments": '{"a": 2, "b": 3}'}]
    broken = 'x<tool_call>{"name": </tool_call>'
    assert parse_tool_calls(broken) == (broken, [])
    two, calls = parse_tool_calls(CALL + CALL.replace("add", "mul"))
    assert two == "" and [call["name"] for call in calls] == ["add", "mul"]


def test_messages_become_template_dicts() -> None:
    message = vf.AssistantMessage(
        content="ok", tool_calls=[vf.ToolCall(id="c1", name="add", arguments="{}")]
    )
    assert to_chat_message(message) == {
        "role": "assistant",
        "content": "ok",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
        ],
    }
    tool = vf.ToolMessage(tool_call_id="c1", content=[{"type": "text", "text": "5"}])
    assert to_chat_message(tool) == {"role": "tool", "content": "5", "tool_call_id": "c1"}


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def _tool_env() -> ClassicEnvironment:
    def answered(completion: Any, answer: str, **_: Any) -> float:
        return float(completion[-1]["content"] == answer)

    env = vf.ToolEnv(
        tools=[add],
        dataset=Dataset.from_list([{"question": "What is 2 + 3?", "answer": "5"}]),
        rubric=vf.Rubric(funcs=[answered]),
        max_turns=3,
    )
    return ClassicEnvironment(env, name="adder")


def _calls_then_answers(prompt: str) -> str:
    return "5" if "<|im_start|>tool\n5" in prompt else CALL


def _tool_rollout(folder: Path, policy: Any, template: str) -> tuple[Any, Any]:
    """(tokenizer, rollout): the adder task played by `_calls_then_answers` under `template`."""
    write_tokenizer(folder, model_max_length=4096)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.chat_template = template
    generator = TurnGenerator(policy(_calls_then_answers), ChatTokenizer(tokenizer), 1024)
    env = _tool_env()
    (rollout,) = asyncio.run(
        env.run_group(env.tasks("train")[0], 1, generator, SamplingConfig(max_tokens=96))
    )
    return tokenizer, rollout


def test_tool_env_runs_tools_and_keeps_a_verbatim_trajectory(tmp_path: Path, policy: Any) -> None:
    tokenizer, rollout = _tool_rollout(tmp_path, policy, TOOL_TEMPLATE)
    assert rollout.error is None and rollout.reward == 1.0
    assert rollout.metrics["add_calls"] == 1.0
    (sequence,) = assemble(rollout.turns)
    text = tokenizer.decode(sequence.token_ids)
    assert text.endswith(
        CALL + "<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n5<|im_end|>"
    )


#: A call in the format Qwen's template (and the tiny model's) renders it.
QWEN_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
#: Plain ChatML: the assistant's `tool_calls` are not rendered, as in many older templates.
PLAIN_CHATML = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _qwen_calls_then_answers(prompt: str) -> str:
    return "5" if "<tool_response>\n5\n</tool_response>" in prompt else QWEN_CALL


def test_the_tiny_template_keeps_a_tool_trajectory_in_one_sequence(
    hf_tokenizer: Any, policy: Any, generator: Any
) -> None:
    env = _tool_env()
    (rollout,) = asyncio.run(
        env.run_group(
            env.tasks("train")[0],
            1,
            generator(policy(_qwen_calls_then_answers)),
            SamplingConfig(max_tokens=96),
        )
    )
    assert rollout.error is None and rollout.reward == 1.0
    (sequence,) = assemble(rollout.turns)  # the model's own call is in its next context
    text = hf_tokenizer.decode(sequence.token_ids)
    assert "<tools>\n" in text and '"name": "add"' in text  # the schema reached the model
    assert text.endswith(
        QWEN_CALL + "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n5<|im_end|>"
    )


def test_a_template_that_drops_tool_calls_splits_the_tool_trajectory(
    tmp_path: Path, policy: Any
) -> None:
    _, rollout = _tool_rollout(tmp_path, policy, PLAIN_CHATML)
    # The call renders as empty content, so the second turn cannot extend the first.
    assert rollout.reward == 1.0
    assert [s.num_turns for s in assemble(rollout.turns)] == [1, 1]
