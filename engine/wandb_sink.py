"""Send a run's metric lines to Weights & Biases, when the config names a W&B project.

Metric lines are the record (`<run>/metrics/<stage>/step_N.jsonl`); W&B is a view of them. The
sink gets each line once, from whoever reads them as they are committed (the stage monitor), so
neither the trainer nor the orchestrator talks to W&B. One W&B run per primeflow run: its id is
the run name, so a resumed or retried run continues the same W&B run. Stages count steps on
their own (SFT 1..300, RL 1..100, eval at the checkpoint's step), so each stage's values are
logged as `<stage>/<key>` against their own step axis, `<stage>/step`.

No credential is passed in: wandb reads `WANDB_API_KEY` from the environment, and without one
the run is written offline to `<dir>/wandb/` for `wandb sync`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engine.config.wandb import WandbConfig, WandbMode
from storage.manifest import scrub_secrets

#: Keys of a metric line that say where it belongs rather than what was measured.
LINE_KEYS = ("stage", "step", "time")


class WandbUnavailableError(RuntimeError):
    """W&B logging is configured but the `wandb` package is not installed."""


def wandb_mode(configured: WandbMode | None) -> WandbMode | None:
    """The config's mode; else None when WANDB_MODE is set, for `wandb.init` reads it itself (in
    its own spellings, `dryrun` too); else online with a key and offline without one."""
    if configured:
        return configured
    if os.environ.get("WANDB_MODE"):
        return None
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def wandb_run_id(run_name: str) -> str:
    """W&B run ids take letters, digits, '-' and '_'; run names may also hold '.'."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", run_name)


def metric_values(line: Mapping[str, Any]) -> dict[str, float | int]:
    """`<stage>/<key>` → value for the numbers of one metric line, with `<stage>/step`."""
    stage = line["stage"]
    values: dict[str, float | int] = {f"{stage}/step": line["step"]}
    for key, value in line.items():
        if key not in LINE_KEYS and isinstance(value, int | float) and not isinstance(value, bool):
            values[f"{stage}/{key}"] = value
    return values


class WandbSink:
    """One W&B run; `log` takes metric lines as `storage.metrics.write_metrics` stores them."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self._stages: set[str] = set()

    def log(self, line: Mapping[str, Any]) -> None:
        stage = line["stage"]
        if stage not in self._stages:
            self.run.define_metric(f"{stage}/step")
            self.run.define_metric(f"{stage}/*", step_metric=f"{stage}/step")
            self._stages.add(stage)
        self.run.log(metric_values(line))

    def close(self) -> None:
        self.run.finish()


def start_wandb_run(
    settings: WandbConfig, run_name: str, run_config: Mapping[str, Any], directory: Path
) -> WandbSink:
    """Start (or resume) run `run_name`'s W&B run, its local files under `directory/wandb/`.

    `run_config` (the resolved config, as JSON) is recorded with secrets scrubbed.
    """
    try:
        import wandb
    except ImportError as exc:
        raise WandbUnavailableError(
            "wandb.project is set but wandb is not installed: pip install 'primeflow[wandb]'"
        ) from exc
    directory.mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=settings.project,
        entity=settings.entity,
        mode=wandb_mode(settings.mode),
        id=wandb_run_id(run_name),
        name=run_name,
        resume="allow",
        reinit="create_new",
        dir=str(directory),
        tags=settings.tags,
        config=scrub_secrets(run_config),
    )
    return WandbSink(run)


@contextmanager
def wandb_sink(
    settings: WandbConfig, run_name: str, run_config: Mapping[str, Any], directory: Path
) -> Iterator[WandbSink | None]:
    """The W&B sink for the length of a `with` block; None when no project is configured."""
    if settings.project is None:
        yield None
        return
    sink = start_wandb_run(settings, run_name, run_config, directory)
    try:
        yield sink
    finally:
        sink.close()
