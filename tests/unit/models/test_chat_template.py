"""The offline tiny model's chat template: plain ChatML, and Qwen's tool format with tools."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from engine.envs.client import parse_tool_calls, to_chat_message
from engine.models.char_tokenizer import write_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    }
]
#: What a model following the format samples after `<|im_start|>assistant\n`.
SAMPLED = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder, model_max_length=512)
    return AutoTokenizer.from_pretrained(folder)


def render(tokenizer, messages, tools=None, generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
    )


def test_without_tools_it_is_plain_chatml(tokenizer) -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    assert render(tokenizer, messages, generation_prompt=True) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tools_and_calls_render_as_qwen_does_and_history_extends_verbatim(tokenizer) -> None:
    question = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "2+3?"}]
    prompt = render(tokenizer, question, TOOLS, generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nUse tools.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "add"' in prompt
    assert prompt.endswith("<|im_end|>\n<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n")
    content, calls = parse_tool_calls(SAMPLED)
    reply = to_chat_message(
        {"role": "assistant", "content": content, "tool_calls": [{**c} for c in calls]}
    )
    result = {"role": "tool", "tool_call_id": calls[0]["id"], "content": "5"}
    history = render(tokenizer, [*question, reply, result], TOOLS, generation_prompt=True)
    # The model's own call is in the next turn's context exactly as it sampled it, so a tool
    # rollout stays one sequence instead of splitting at every call.
    assert history.startswith(prompt + SAMPLED + "<|im_end|>\n")
    assert history.endswith(
        "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
