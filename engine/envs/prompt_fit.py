"""How long an environment's first prompts are once rendered: the chat template applied to the
messages, system prompt and tool schemas included, as the first turn will send them.

A prompt that leaves no room for the sampled tokens is skipped at run time; an environment whose
prompts all do so can train nothing, so `engine.preflight` refuses it before any pool starts,
naming the `seq_len` it needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.envs.base import Environment, Split
from engine.envs.turns import ChatTokenizer

#: Tasks rendered per environment and split, spread over the split.
SAMPLE = 64


@dataclass(frozen=True)
class LongestPrompt:
    example_id: int
    tokens: int


def longest_prompt(
    env: Environment, tokenizer: ChatTokenizer, split: Split, sample: int = SAMPLE
) -> LongestPrompt | None:
    """The longest first prompt among up to `sample` tasks spread over `split` (None: none)."""
    tasks = env.tasks(split)
    if not len(tasks):
        return None
    step = max(1, len(tasks) // sample)
    longest: LongestPrompt | None = None
    for index in range(0, len(tasks), step)[:sample]:
        task = tasks[index]
        rendered = tokenizer.render(task.prompt, env.prompt_tools(task))
        tokens = len(tokenizer.encode(rendered))
        if longest is None or tokens > longest.tokens:
            longest = LongestPrompt(task.example_id, tokens)
    return longest
