"""What a reload pays for its HTTP clients: a control client with the pool's shared TLS context
against one with httpx's own, built per client.

    .venv/bin/python -m tests.bench.inference.bench_control_client

A reload opens one control client per server (`engine.inference.control.control_client`), in
one thread each. httpx builds a TLS context for every client by default, reading the CA bundle,
and those threads hold the GIL while they do: on a GPU reference run 0.16 s of a 0.39 s reload
lay outside its measured phases. Reported: the median seconds to open and close a client each
way, alternating, and shared over default, measured in the same run.

The file name does not match `test_*.py`, so test runs never collect it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from engine.inference.control import control_client
from tests.bench.e2e.bench_async import emit

URL = "http://127.0.0.1:8000"


def opened(make: Callable[[], httpx.Client]) -> float:
    started = time.perf_counter()
    make().close()
    return time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.inference.bench_control_client")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    ways: dict[str, Callable[[], httpx.Client]] = {
        "shared": lambda: control_client(URL, "key", 60.0),
        "default": lambda: httpx.Client(base_url=URL, headers={"Authorization": "key"}),
    }
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    for round_ in range(args.rounds):
        for way in list(ways) if round_ % 2 == 0 else list(ways)[::-1]:
            seconds[way].append(opened(ways[way]))
    median = {way: statistics.median(values) for way, values in seconds.items()}
    result = {
        "settings": vars(args),
        "client_s": median,
        "shared_over_default": median["shared"] / median["default"],
    }
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
