"""A character-level ChatML tokenizer, built locally with the `tokenizers` library.

The tiny model must work with no hub, so its tokenizer is built here rather than downloaded.
One token per character keeps the vocabulary at ~100 entries (a small embedding, fast tests) and
makes every string round-trip exactly, which tests and the reverse-text task rely on. The files
are the standard `tokenizer.json` + `tokenizer_config.json`, so `AutoTokenizer` and vLLM load
them like any Hugging Face tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
#: Stands in for any character outside the vocabulary (non-ASCII text), so encoding never fails.
UNK = "<|unk|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, UNK)
#: Printable ASCII plus the two whitespace controls that chat text needs.
CHARACTERS = ("\t", "\n", *(chr(code) for code in range(32, 127)))

#: ChatML, as Qwen models render it: each message `<|im_start|>role\ncontent<|im_end|>\n`. With
#: `tools`, Qwen's tool format: the schemas in the system turn inside `<tools></tools>`, each
#: call of an assistant turn as `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`,
#: and tool results as `<tool_response>` blocks of one user turn, so a tool rollout's history is
#: rendered as the model wrote it and the model sees the schemas. Without tools, plain ChatML.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>'
    "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools and loop.first %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{%- set arguments = call['arguments'] if call['arguments'] is string "
    "else (call['arguments'] | tojson) %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' + arguments "
    "+ '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_char_tokenizer() -> Tokenizer:
    """Special tokens get ids 0-3, then one id per character in `CHARACTERS`' order."""
    vocab = {token: index for index, token in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own pre-token; `[\s\S]` also matches newlines, which `.` does not.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    # Registered as added special tokens, ChatML markers are matched whole before splitting.
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def write_tokenizer(folder: Path, *, model_max_length: int) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` (ChatML template, eos `<|im_end|>`)."""
    folder.mkdir(parents=True, exist_ok=True)
    build_char_tokenizer().save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": UNK,
        "additional_special_tokens": [IM_START],
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    (folder / "tokenizer_config.json").write_text(text, encoding="utf-8")
