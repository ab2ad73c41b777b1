"""The closing summary `primeflow pipeline` prints: rewards per policy, time per stage, where
the run lives and where to look in the Prefect UI."""

from __future__ import annotations

from engine.results import PipelineResult


def _duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest:02d}s" if minutes else f"{rest}s"


def _reward(value: float | None) -> str:
    return f"{value:.3f}" if isinstance(value, float) else "-"


def _gains(results: PipelineResult) -> list[str]:
    """The paired gain of each policy over the one before it, a line each."""
    lines = results.report.gain_lines() if results.report is not None else []
    if not lines:
        return []
    return [
        "",
        *(("  gain:     " if i == 0 else "            ") + line for i, line in enumerate(lines)),
    ]


def _signal(results: PipelineResult) -> list[str]:
    line = results.report.signal_line() if results.report is not None else None
    return ["  signal:   " + line] if line else []


def render(results: PipelineResult, *, k: int, temperature: float, ui_url: str) -> str:
    """Plain text for a terminal: a small table, then stages, then locations."""
    rows = [("policy", f"reward (T={temperature:g}, avg@{k})", "greedy", "samples", "results")]
    stderrs = results.report.stderr if results.report is not None else {}
    for name, value in results.evals():
        stderr = stderrs.get(name)
        noise = f" ± {stderr:.3f}" if stderr is not None else ""
        rows.append(
            (
                name,
                _reward(value.metrics.get(f"avg@{k}")) + noise,
                _reward(value.metrics.get("greedy/avg@1")),
                str(value.samples),
                value.uri,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    stages = [
        f"{stage.stage} {stage.last_step} steps in {_duration(stage.seconds)}"
        for stage in results.stages()
    ]
    if evals := [value for _, value in results.evals()]:
        stages.append(f"{len(evals)} evals in {_duration(sum(e.seconds for e in evals))}")
    lines = [
        f"primeflow run {results.run}",
        "",
        *("  " + line for line in table),
        *_gains(results),
        *_signal(results),
        "",
        "  stages:   " + " · ".join(stages),
        f"  run root: {results.root}",
        "            manifest.json, rollouts/, checkpoints/, eval/, metrics.jsonl, logs/",
        f"  Prefect:  {ui_url}",
    ]
    if results.report is not None:
        lines.insert(-1, f"  plot:     {results.report.plot}")
    return "\n".join(lines)
