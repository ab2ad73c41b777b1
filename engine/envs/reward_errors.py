"""Catch the reward-function errors that verifiers turns into a reward of 0.0.

A classic verifiers `Rubric` calls each reward function inside `try/except Exception`, logs
"Error calling reward function <name>: <error>" and scores the rollout 0.0. Trained on, that
0.0 is a false signal: a correct answer the buggy function could not grade reads as a wrong
one, and nothing in the run's metrics says so. primeflow wants such a group counted and skipped
(`env_error`), like any other environment failure, so the rubric's error log lines are captured
while one group is scored.

The capture is scoped with a `ContextVar`: groups of one environment are scored concurrently on
one event loop and share the rubric's logger, but each scoring call (and the tasks it spawns)
sees only its own list, so an error is never blamed on another group.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

_ERRORS: ContextVar[list[str] | None] = ContextVar("primeflow_reward_errors", default=None)
_PREFIXES = ("Error calling reward function ", "Error calling group reward function ")


class _Capture(logging.Handler):
    """Appends the rubric's reward-error lines to the current scoring call's list."""

    def emit(self, record: logging.LogRecord) -> None:
        errors = _ERRORS.get()
        if errors is None:
            return
        message = record.getMessage()
        if message.startswith(_PREFIXES):
            errors.append(message.removeprefix("Error calling ").splitlines()[0])


_HANDLER = _Capture(level=logging.ERROR)


def _rubric_loggers(rubric: Any) -> Iterator[logging.Logger]:
    """The logger of `rubric` and of every rubric inside it (a `RubricGroup` holds several)."""
    logger = getattr(rubric, "logger", None)
    if isinstance(logger, logging.Logger):
        yield logger
    for inner in getattr(rubric, "rubrics", None) or ():
        yield from _rubric_loggers(inner)


@contextlib.contextmanager
def reward_errors(rubric: Any) -> Iterator[list[str]]:
    """Within the block, reward-function errors the rubric swallows land in the yielded list,
    one line each: "reward function <name>: <error>"."""
    for logger in _rubric_loggers(rubric):
        if _HANDLER not in logger.handlers:
            logger.addHandler(_HANDLER)
    errors: list[str] = []
    token = _ERRORS.set(errors)
    try:
        yield errors
    finally:
        _ERRORS.reset(token)
