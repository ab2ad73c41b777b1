"""When a stage that makes no progress counts as hung (`engine.watchdog`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from engine.config.base import BaseConfig


class WatchdogConfig(BaseConfig):
    """A stage fails as hung after `factor` × its recent step time without a new step (at least
    `min_s`; `startup_s` before its first step), with the stacks of its processes saved."""

    enabled: Annotated[bool, Field(description="Fail hung stages (off: wait forever).")] = True
    factor: Annotated[
        float, Field(gt=1, description="Allowed silence, in multiples of the median recent step.")
    ] = 10.0
    min_s: Annotated[
        float, Field(gt=0, description="Never call a stage hung sooner than this (seconds).")
    ] = 300.0
    startup_s: Annotated[
        float,
        Field(
            gt=0,
            description="Allowed time to the stage's first new step: model load, compile, the "
            "first rollouts (seconds).",
        ),
    ] = 1800.0
