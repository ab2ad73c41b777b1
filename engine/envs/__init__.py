"""Environments behind one interface: built-ins, classic verifiers packages, v1 tasksets."""

from engine.envs.base import Environment, Rollout, Split, Task
from engine.envs.loader import BUILTIN_ENVS, load_environment
from engine.envs.mix import EnvMix, MixEntry
from engine.envs.sampler import Sample, Sampler
from engine.envs.trajectory import TokenSequence, assemble
from engine.envs.turns import (
    ChatTokenizer,
    PromptTooLongError,
    SamplerFailedError,
    Turn,
    TurnGenerator,
)

__all__ = [
    "BUILTIN_ENVS",
    "ChatTokenizer",
    "EnvMix",
    "Environment",
    "MixEntry",
    "PromptTooLongError",
    "Rollout",
    "Sample",
    "Sampler",
    "SamplerFailedError",
    "Split",
    "Task",
    "TokenSequence",
    "Turn",
    "TurnGenerator",
    "assemble",
    "load_environment",
]
