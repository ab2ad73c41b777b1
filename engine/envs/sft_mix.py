"""SFT rows from several environments at once: a warm-up that teaches more than one task, such
as the base model that LoRA tenants of shared pools then adapt each to its own
(`configs/multi_tenant/base.toml`):

    [sft.data]
    env = "sft-mix"
    env_args = { envs = ["reverse-text", "alphabet-sort"] }

Each environment contributes an equal share of `num_examples`, drawn by its own
`sft_examples(num_examples, seed)` exactly as it draws them alone, and the rows alternate
between environments, so any slice of the data holds every task.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain, zip_longest
from typing import Any

from engine.envs.loader import import_environment


def sft_examples(
    num_examples: int, seed: int = 0, envs: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """`num_examples` rows, the environments `envs` (ids, as in `orchestrator.envs`) in turn."""
    if len(envs) < 2:
        raise ValueError(f"sft-mix needs env_args.envs to name two environments or more: {envs}")
    if num_examples < len(envs):
        raise ValueError(f"sft-mix: num_examples = {num_examples} is fewer than the environments")
    shares = [num_examples // len(envs) + (i < num_examples % len(envs)) for i in range(len(envs))]
    parts = []
    for env, share in zip(envs, shares, strict=True):
        source = getattr(import_environment(env), "sft_examples", None)
        if not callable(source):
            raise ValueError(f"sft-mix: environment {env!r} makes no SFT data (no sft_examples)")
        parts.append(list(source(num_examples=share, seed=seed)))
    return [row for row in chain.from_iterable(zip_longest(*parts)) if row is not None]
