"""Where a run lives: its name, seed, parent, and the object store under it."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from pydantic import Field, field_validator

from engine.config.base import BaseConfig
from storage.layout import validate_run_name


def default_run_name() -> str:
    """A sortable, unique-enough name so two runs started without a name never share a root."""
    return datetime.now(UTC).strftime("run-%Y%m%d-%H%M%S")


class RunConfig(BaseConfig):
    """Identity of one run: `<storage.uri>/<run.name>` is its root."""

    # `= Field(...)`, not `Annotated[..., Field(...)]`: type checkers see a default only there,
    # and `RunConfig()` (the root's default factory) must type-check without a name.
    name: str = Field(
        default_factory=default_run_name,
        description=(
            "Run name: letters, digits, '.', '_' and '-'. Reusing a name resumes that run "
            "from its last committed step. Default: run-<UTC time>."
        ),
    )
    seed: Annotated[int, Field(ge=0, description="Seed for data order, sampling and init.")] = 0
    parent: Annotated[
        str | None,
        Field(description="URI of the run this one continues from (recorded in the manifest)."),
    ] = None

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        return validate_run_name(value)


class StorageConfig(BaseConfig):
    """The object store every pool reads and writes. Credentials come from the environment only."""

    uri: Annotated[
        str,
        Field(
            min_length=1,
            description="Root under which runs live: file://./runs, s3://bucket/prefix, gs://...",
        ),
    ] = "file://./runs"
    endpoint_url: Annotated[
        str | None,
        Field(
            description="S3-compatible endpoint (MinIO, SeaweedFS...); AWS_ENDPOINT_URL if unset."
        ),
    ] = None
    region: Annotated[str | None, Field(description="S3 region; AWS_DEFAULT_REGION if unset.")] = (
        None
    )
    retries: Annotated[
        int, Field(ge=0, le=20, description="Retries of a transient storage fault.")
    ] = 5
    backoff_s: Annotated[
        float, Field(gt=0, le=60, description="First retry delay; doubles per retry, with jitter.")
    ] = 0.2

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, value: str) -> str:
        scheme = value.split("://", 1)[0] if "://" in value else "file"
        if scheme not in {"file", "memory", "s3", "gs", "gcs"}:
            raise ValueError(
                f"unsupported scheme {scheme!r}: use file://, memory://, s3:// or gs://"
            )
        return value
