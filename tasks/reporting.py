"""Mirror a stage's progress from the run's object store into the Prefect UI.

The trainer pool runs in other processes (torchrun) and may run on other machines, so it cannot
call Prefect; what it commits to storage is the truth. A `StageMonitor` polls that truth — the
metric lines and the committed checkpoints — and turns it into a progress artifact, a metrics
table artifact every few steps, and one `primeflow.checkpoint.committed` event per checkpoint,
recorded in storage once sent (`announced/`), so that a checkpoint committed while no monitor
watched is announced when the run is next watched, and none twice. It reads only objects it
has not seen, so a poll costs one listing per prefix.
"""

from __future__ import annotations

import base64
import contextvars
import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any
from uuid import UUID

from prefect import get_run_logger
from prefect.artifacts import (
    create_image_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.events import emit_event
from prefect.exceptions import MissingContextError
from tqdm import tqdm

from engine.config import PrimeflowConfig
from engine.report.run_report import PLOT, REPORT_DIR
from engine.results import PipelineResult
from engine.run import Run
from storage.checkpoints import announced_steps, log_announced, logged_commits
from storage.commit import committed_steps
from storage.layout import RunLayout
from storage.paths import join
from storage.store import ObjectStore

CHECKPOINT_EVENT = "primeflow.checkpoint.committed"
#: Metrics shown beside a stage's progress bar, when the stage reports them.
BAR_METRICS = ("loss", "reward/mean", "eval_loss", "eval/greedy/avg@1")
#: The metrics table's first and last columns; the others sit between them by name.
TABLE_FIRST = (
    "step", "reward/mean", "eval/greedy/avg@1", "entropy", "advantage/zero_group_fraction",
    "loss", "eval_loss", "policy_version",
)  # fmt: skip
TABLE_LAST = ("stage", "time")
log = logging.getLogger(__name__)


def run_logger() -> logging.Logger | logging.LoggerAdapter[Any]:
    """The flow or task run's logger (its lines reach the UI), else this module's."""
    try:
        return get_run_logger()
    except MissingContextError:
        return log


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow only lowercase letters, digits and dashes."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")


def run_resource(run_name: str, stage: str) -> dict[str, str]:
    """The Prefect event resource that stands for one stage of a primeflow run; triggers match
    on its labels (`primeflow.stage: rl` picks RL checkpoints)."""
    return {
        "prefect.resource.id": f"primeflow.run.{run_name}",
        "primeflow.run": run_name,
        "primeflow.stage": stage,
    }


def emit_checkpoint_event(run_name: str, stage: str, step: int, uri: str, root: str) -> None:
    """`root` is the run's root URI: a triggered evaluation reads the run from there."""
    emit_event(
        CHECKPOINT_EVENT,
        resource=run_resource(run_name, stage),
        payload={"run": run_name, "stage": stage, "step": step, "uri": uri, "root": root},
    )


def announce_checkpoints(
    store: ObjectStore, run_name: str, stage: str, parent: str, announced: set[int] | None = None
) -> list[int]:
    """One checkpoint event for each checkpoint of `parent` committed and not announced yet
    (each is then recorded as announced): those of a running stage as they come, and those a
    trainer committed while no flow watched it (its flow process was killed, the trainer went
    on), when the run is next watched. `announced`: the steps recorded so far, when the caller
    keeps them (a monitor reads the record once, not at every poll), updated here. The steps
    announced now, in order."""
    if announced is None:
        announced = set(announced_steps(store, parent))
    present = set(committed_steps(store, parent))
    committed = present | set(logged_commits(store, parent))
    news = sorted(committed - announced)
    for step in news:
        if step not in present:
            log.warning(
                "%s: checkpoint %d was deleted by retention before it was announced; its "
                "event goes out, but it cannot be evaluated (raise checkpoint.keep_last)",
                stage,
                step,
            )
        uri = store.url(join(parent, RunLayout.step_name(step)))
        emit_checkpoint_event(run_name, stage, step, uri, store.url())
        log_announced(store, step, parent)
        announced.add(step)
    return news


#: How long a stage's end waits for its last progress report: after it completed, and after
#: it failed or was cancelled.
FINAL_REPORT_S = 30.0
ABORT_REPORT_S = 3.0


@dataclass
class StageMonitor:
    """Context manager: while the stage runs, poll storage and report; report once more at exit.

    `stage`'s metric lines measure progress; lines of the `also` stages (the orchestrator's,
    beside the RL trainer's) join them in the table, the bar and `on_step`.
    """

    store: ObjectStore
    run_name: str
    stage: str
    total_steps: int
    checkpoint_parent: str = "checkpoints"
    also: tuple[str, ...] = ()
    interval_s: float = 2.0
    table_every: int = 10
    table_rows: int = 20
    #: Off a terminal (output to a file, a worker's log) the bar is silent: a progress line
    #: goes to the run's log at most this often instead, and at the last step.
    line_every_s: float = 60.0
    on_step: Callable[[Mapping[str, Any]], None] | None = None
    lines: dict[int, dict[str, Any]] = field(default_factory=dict, init=False)
    others: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict, init=False)
    _artifact: UUID | None = field(default=None, init=False)
    _last_table_step: int = field(default=-1, init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)
    _bar: tqdm | None = field(default=None, init=False)
    _announced: set[int] = field(default_factory=set, init=False)
    _line_at: float = field(default=-math.inf, init=False)

    def __enter__(self) -> StageMonitor:
        key = artifact_key(self.run_name, self.stage, "progress")
        self._artifact = create_progress_artifact(
            progress=0.0, key=key, description=f"{self.stage}: steps done of {self.total_steps}"
        )
        # A terminal progress bar when a person watches (tqdm stays silent off a TTY).
        self._bar = tqdm(total=self.total_steps, desc=self.stage, unit="step", disable=None)
        self._announced = set(announced_steps(self.store, self.checkpoint_parent))
        context = contextvars.copy_context()  # so artifacts attach to this flow/task run
        self._thread = threading.Thread(target=context.run, args=(self._loop,), daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            # A stage that failed or was cancelled must end promptly (a cancelled tenant gives
            # its slot back within seconds), whatever a report waits on: a Prefect request
            # that the server never answers holds the thread for the API timeout (a minute).
            self._thread.join(timeout=FINAL_REPORT_S if exc_type is None else ABORT_REPORT_S)
            if self._thread.is_alive():
                log.warning("%s: the last progress report did not finish; not waiting", self.stage)
        if self._bar is not None:
            self._bar.close()

    def _loop(self) -> None:
        """Report every `interval_s`, and once more when the stage ends (on this thread too, so
        that the stage's exit never waits on the Prefect server longer than it chooses to)."""
        while not self._stop.wait(self.interval_s):
            self._report()
        self._report(final=True)

    def _report(self, final: bool = False) -> None:
        """Poll and update the UI; a failure (the Prefect server restarting, say) is a warning:
        reporting must never fail the stage it reports on, not even its last report."""
        try:
            self.poll()
            if final:
                self._write_table(force=True)
        except Exception as exc:
            log.warning("progress report failed: %s", exc)

    @property
    def last_step(self) -> int:
        return max(self.lines, default=0)

    def poll(self) -> None:
        """Read new metric lines and checkpoints; update the UI for what changed."""
        new_lines = self._read_new_lines()
        if new_lines and self._bar is not None:
            self._bar.update(self.last_step - self._bar.n)
            shown = self.latest_numbers(BAR_METRICS)
            self._bar.set_postfix(shown, refresh=False)
            if self._bar.disable:
                self._progress_line(shown)
        if new_lines and self._artifact is not None:
            progress = min(100.0, 100.0 * self.last_step / max(self.total_steps, 1))
            update_progress_artifact(self._artifact, progress=progress)
            if self.last_step - self._last_table_step >= self.table_every:
                self._write_table()
        announce_checkpoints(
            self.store, self.run_name, self.stage, self.checkpoint_parent, self._announced
        )

    def _progress_line(self, shown: Mapping[str, float]) -> None:
        """One line of progress for a log, at most every `line_every_s` and at the end."""
        done = self.last_step >= self.total_steps
        if not done and time.monotonic() - self._line_at < self.line_every_s:
            return
        self._line_at = time.monotonic()
        numbers = "".join(f", {key} {value:.4g}" for key, value in shown.items())
        run_logger().info("%s: step %d/%d%s", self.stage, self.last_step, self.total_steps, numbers)

    def _read_new_lines(self) -> list[dict[str, Any]]:
        """New lines of `stage`; new lines of the `also` stages are read and kept on the side."""
        new = self._read_stage(self.stage, self.lines)
        for stage in self.also:
            self._read_stage(stage, self.others.setdefault(stage, {}))
        return new

    def _read_stage(self, stage: str, seen: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
        prefix = RunLayout.metrics_dir(stage)
        new = []
        for name in self.store.list(prefix):
            step = RunLayout.parse_step(name.removesuffix(".jsonl"))
            if step is None or step in seen:
                continue
            line = json.loads(self.store.read_bytes(join(prefix, name)))
            seen[step] = line
            new.append(line)
            if self.on_step is not None:
                self.on_step(line)
        return new

    def latest_numbers(self, keys: tuple[str, ...]) -> dict[str, float]:
        """Each of `keys` from the newest step that has it: evaluations (`eval_loss`, the
        held-out reward during RL) come every few steps, and should not blink out between."""
        found: dict[str, float] = {}
        steps = sorted({*self.lines, *(s for lines in self.others.values() for s in lines)})
        for step in reversed(steps):
            row = self.row(step)
            for key in keys:
                if key not in found and isinstance(row.get(key), int | float):
                    found[key] = row[key]
            if len(found) == len(keys):
                break
        return {key: found[key] for key in keys if key in found}

    def row(self, step: int) -> dict[str, Any]:
        """Step `step`'s numbers from every watched stage, in one flat row."""
        merged = dict(self.lines.get(step, {}))
        for lines in self.others.values():
            merged.update({k: v for k, v in lines.get(step, {}).items() if k not in merged})
        return merged

    def _write_table(self, force: bool = False) -> None:
        if not self.lines or (not force and self.last_step == self._last_table_step):
            return
        rows = [
            table_row({k: v for k, v in self.row(s).items() if isinstance(v, int | float | str)})
            for s in sorted(self.lines)[-self.table_rows :]
        ]
        create_table_artifact(
            table=rows,
            key=artifact_key(self.run_name, self.stage, "metrics"),
            description=f"{self.stage}: the last {len(rows)} steps' metrics",
        )
        self._last_table_step = self.last_step


def table_row(line: Mapping[str, Any]) -> dict[str, Any]:
    """`line`'s columns in the order a person reads them: the step and headline numbers first,
    the rest grouped by prefix (`reward/…`, `time/…`), bookkeeping last. Metric lines are
    stored with sorted keys, which put `step` 13th and `reward/mean` 36th."""
    first = [key for key in TABLE_FIRST if key in line]
    last = [key for key in TABLE_LAST if key in line]
    middle = sorted(set(line) - set(first) - set(last), key=lambda k: ("/" in k, k))
    return {key: line[key] for key in (*first, *middle, *last)}


def _number(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value if value is not None else "-")


def summary_markdown(config: PrimeflowConfig, results: PipelineResult) -> str:
    """The run's closing summary: reward per policy, then where every output lives."""
    root = results.root
    lines = [f"# primeflow run `{config.run.name}`", "", "## Reward on the held-out split", ""]
    if evals := results.evals():
        k = config.eval.rollouts_per_example
        lines += [
            f"| policy | avg@{k} (sampled) | greedy avg@1 | pass@{k} | results |",
            "|---|---|---|---|---|",
        ]
        for name, value in evals:
            lines.append(
                f"| {name} | {_number(value.metrics.get(f'avg@{k}'))} | "
                f"{_number(value.metrics.get('greedy/avg@1'))} | "
                f"{_number(value.metrics.get(f'pass@{k}'))} | `{value.uri}` |"
            )
    if results.report is not None and (gains := results.report.gain_lines()):
        lines += ["", *(f"- {line}" for line in gains)]
    if results.report is not None and (signal := results.report.signal_line()):
        lines += ["", f"- {signal}"]
    lines += ["", "## Stages", ""]
    for stage in results.stages():
        lines.append(
            f"- **{stage.stage}**: {stage.last_step} steps; last checkpoint `{stage.checkpoint}`"
        )
    lines += [
        "",
        "## Where the run lives",
        "",
        f"- run root: `{root}`",
        f"- manifest: `{root}/{RunLayout.MANIFEST}`",
        f"- rollout shards: `{root}/{RunLayout.ROLLOUTS}/`",
        f"- checkpoints: `{root}/{RunLayout.CHECKPOINTS}/`",
        f"- metrics: `{root}/{RunLayout.METRICS_DIR}/` (and `{root}/{RunLayout.METRICS}`)",
    ]
    if (report := results.report) is not None:
        lines += [
            f"- reward and loss per step (plot, shown as the artifact "
            f"`{artifact_key(config.run.name, 'reward-plot')}`): `{report.plot}`",
            f"- sample answers before and after: `{report.samples_md}`",
            f"- eval statistics (stderr, paired differences): `{report.report}`",
        ]
    return "\n".join(lines) + "\n"


def publish_hang_report(run_name: str, stage: str, report: Path, limit: int = 60_000) -> None:
    """The stacks of a hung stage, in the UI beside the failure that names their file."""
    text = report.read_text(errors="replace")
    if len(text) > limit:
        text = text[:limit] + f"\n... (cut; the whole report is {report})\n"
    create_markdown_artifact(
        markdown=f"# {stage} hung\n\nFull report: `{report}`\n\n```\n{text}\n```\n",
        key=artifact_key(run_name, stage, "hang"),
        description=f"{stage}: the stacks of every process when the stage was found hung",
    )


def publish_summary(config: PrimeflowConfig, run: Run, results: PipelineResult) -> None:
    """The summary, and the reward plot as an image the UI shows (a `data:` URL: the plot's
    own URI is a `file://` or `s3://` path no browser opens)."""
    create_markdown_artifact(
        markdown=summary_markdown(config, results),
        key=artifact_key(config.run.name, "summary"),
        description=f"primeflow run {config.run.name}: rewards, stages and outputs",
    )
    if results.report is not None:
        png = run.store.read_bytes(join(REPORT_DIR, PLOT))
        create_image_artifact(
            image_url=f"data:image/png;base64,{base64.b64encode(png).decode()}",
            key=artifact_key(config.run.name, "reward-plot"),
            description=f"primeflow run {config.run.name}: reward and loss per step",
        )
