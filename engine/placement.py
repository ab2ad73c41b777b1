"""CPU placement: core lists and binding a process to them.

On a CPU machine the trainer and the vLLM servers share cores. Left to themselves, their OpenMP
threads spin against each other and a 2-core machine gets little more than one core of work
out of both (measured: an RL step of the demo took 8 s unpinned and ~3 s with the trainer on one
core and vLLM on the other). Lists use the syntax of `taskset -c` and vLLM's
`VLLM_CPU_OMP_THREADS_BIND`: `0`, `0-3`, `0,2,4-7`; vLLM's `|` between tensor-parallel ranks'
lists is accepted and the lists are joined.
"""

from __future__ import annotations

import os


def parse_cores(spec: str) -> set[int]:
    """The cores a list names; a ValueError naming the bad part otherwise."""
    cores: set[int] = set()
    for part in spec.replace("|", ",").split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"{spec!r} is not a core list like '0', '0-3' or '0,2-3'")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ValueError(f"{spec!r}: the range {part.strip()!r} runs backwards")
        cores.update(range(first, last + 1))
    return cores


def bind_to_cores(spec: str, what: str) -> set[int]:
    """Bind this process (and what it starts afterwards) to the cores of `spec`.

    `what` names the setting in the error, since a wrong core number is a config mistake.
    """
    cores = parse_cores(spec)
    available = os.sched_getaffinity(0)
    missing = cores - available
    if missing:
        raise ValueError(
            f"{what} = {spec!r}: cores {sorted(missing)} are not available to this process "
            f"(it may use {sorted(available)})"
        )
    os.sched_setaffinity(0, cores)
    return cores
