"""Which rank writes each whole tensor of a snapshot (a full policy version, a resume checkpoint).

Gathering a tensor is a collective every rank takes part in, but only its owner copies it to
the host and writes it, so the write is spread over the ranks and no rank holds the whole
model in host memory.
"""

from __future__ import annotations

from collections.abc import Mapping


def assign_owners(sizes: Mapping[str, int], world: int) -> dict[str, int]:
    """Which rank writes each whole tensor of a full version: the largest first, each to the
    rank with the fewest entries so far, so every rank writes about 1/world of the bytes.

    The same on every rank (it depends on the sizes alone).
    """
    load = [0] * world
    owners: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += sizes[name]
    return owners
