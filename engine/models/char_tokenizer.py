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

#: ChatML, as Qwen models render it: each message `<|im_start|>role\ncontent<|im_end|>\n`.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
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
