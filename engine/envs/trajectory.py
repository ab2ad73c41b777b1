"""A rollout's turns → token sequences to train on, with the sampled tokens marked.

A multi-turn conversation becomes one sequence when every turn's prompt starts with everything
before it (earlier prompts and sampled tokens, verbatim). Where a prompt does not (the chat
template rewrote history), the conversation is split into several sequences at that turn, so
each sequence holds only tokens in the order the model saw them; the split is counted by the
caller.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.envs.turns import Turn


@dataclass(frozen=True)
class TokenSequence:
    """Token-aligned training data for one sequence of a rollout."""

    token_ids: list[int]
    #: True on tokens the model sampled; prompt and environment tokens are False.
    loss_mask: list[bool]
    #: Inference log-prob on sampled tokens, 0.0 elsewhere (same length as `token_ids`).
    logprobs: list[float]
    #: Tokens before the first sampled one.
    prompt_len: int
    #: The oldest policy version behind any sampled token of the sequence.
    policy_version: int
    num_turns: int
    #: The last turn stopped at `max_tokens` (or the context) rather than by itself.
    is_truncated: bool
    #: The policy version that sampled each token (a turn's weights; weights can change
    #: between turns of a long rollout), -1 on prompt and environment tokens; [] when unknown.
    token_versions: list[int] = field(default_factory=list)
    #: The lineage id of `policy_version` (its turn's; '' when unknown).
    policy_lineage: str = ""

    @property
    def completion_len(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def sampled_tokens(self) -> int:
        return sum(self.loss_mask)


def _extends(sequence: list[int], prompt: Sequence[int]) -> bool:
    return len(prompt) >= len(sequence) and list(prompt[: len(sequence)]) == sequence


def _segments(turns: Sequence[Turn]) -> list[list[Turn]]:
    """Turns grouped into runs where each prompt extends the sequence so far."""
    segments: list[list[Turn]] = []
    sequence: list[int] = []
    for turn in turns:
        if not segments or not _extends(sequence, turn.prompt_ids):
            segments.append([])
            sequence = []
        segments[-1].append(turn)
        sequence = [*turn.prompt_ids, *turn.completion_ids]
    return segments


def _sequence(turns: list[Turn]) -> TokenSequence:
    token_ids: list[int] = []
    loss_mask: list[bool] = []
    logprobs: list[float] = []
    versions: list[int] = []
    for turn in turns:
        context = turn.prompt_ids[len(token_ids) :]
        token_ids.extend(context)
        loss_mask.extend([False] * len(context))
        logprobs.extend([0.0] * len(context))
        versions.extend([-1] * len(context))
        if len(turn.logprobs) != len(turn.completion_ids):
            raise ValueError(
                f"turn has {len(turn.completion_ids)} sampled tokens but "
                f"{len(turn.logprobs)} log-probs"
            )
        token_ids.extend(turn.completion_ids)
        loss_mask.extend([True] * len(turn.completion_ids))
        logprobs.extend(turn.logprobs)
        versions.extend([turn.policy_version] * len(turn.completion_ids))
    oldest = min(turns, key=lambda turn: turn.policy_version)
    return TokenSequence(
        token_ids=token_ids,
        loss_mask=loss_mask,
        logprobs=logprobs,
        prompt_len=len(turns[0].prompt_ids),
        policy_version=oldest.policy_version,
        num_turns=len(turns),
        is_truncated=turns[-1].is_truncated,
        token_versions=versions,
        policy_lineage=oldest.policy_lineage,
    )


def assemble(turns: Sequence[Turn]) -> list[TokenSequence]:
    """One sequence per run of verbatim-extending turns (one for a well-behaved rollout)."""
    return [_sequence(segment) for segment in _segments(turns)]
