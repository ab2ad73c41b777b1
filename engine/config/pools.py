"""Shared pools: one inference pool and one trainer pool that outlive any flow run and train
several LoRA runs ("tenants") at once (docs/tenants.md)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator

from engine.config.base import BaseConfig
from storage.layout import validate_folder_name


class SharedPoolsConfig(BaseConfig):
    """Which shared pool pair a run uses: `primeflow pools up` starts it, a LoRA run with
    `pools.name` set trains on it as one tenant. Unset: the run starts pools of its own."""

    name: Annotated[
        str | None,
        Field(
            description="The shared pool pair: `pools up` starts it, a run with it set is one "
            "of its tenants. None: the run gets pools of its own."
        ),
    ] = None
    tenants: Annotated[
        int,
        Field(
            ge=1,
            le=64,
            description="Tenants the pools train at once (`pools up`); further runs wait for a "
            "slot in Prefect's concurrency limit `primeflow-pool-<name>`.",
        ),
    ] = 2
    lease_s: Annotated[
        float,
        Field(
            gt=0,
            description="A tenant whose run has not renewed its lease for this long is taken "
            "to have died: the trainer lets it go, keeping every step it committed.",
        ),
    ] = 30.0
    heartbeat_s: Annotated[
        float, Field(gt=0, description="How often a tenant renews its lease.")
    ] = 2.0
    poll_s: Annotated[
        float,
        Field(gt=0, description="How often the shared trainer looks for work when it has none."),
    ] = 0.2

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str | None) -> str | None:
        return value if value is None else validate_folder_name(value, "pools name")
