"""The closing summary `primeflow pipeline` prints: rewards per policy, time per stage, where
the run lives and where to look in the Prefect UI."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

POLICIES = ("base", "sft", "rl")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest:02d}s" if minutes else f"{rest}s"


def _reward(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else "-"


def render(results: Mapping[str, Any], *, k: int, temperature: float, ui_url: str) -> str:
    """Plain text for a terminal: a small table, then stages, then locations."""
    rows = [("policy", f"reward (T={temperature:g}, avg@{k})", "greedy", "samples", "results")]
    report = results.get("report") or {}
    for name in POLICIES:
        value = results.get(f"eval_{name}")
        if isinstance(value, Mapping):
            stderr = report.get("evals", {}).get(name, {}).get("sampled", {}).get("stderr")
            noise = f" ± {stderr:.3f}" if isinstance(stderr, float) else ""
            rows.append(
                (
                    name,
                    _reward(value.get(f"avg@{k}")) + noise,
                    _reward(value.get("greedy/avg@1")),
                    str(value.get("samples", "-")),
                    str(value.get("uri", "-")),
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    stages = []
    for name in ("sft", "rl"):
        value = results.get(name)
        if isinstance(value, Mapping):
            stages.append(
                f"{name} {value.get('last_step')} steps in {_duration(value.get('seconds'))}"
            )
    evals = [v for n in POLICIES if isinstance(v := results.get(f"eval_{n}"), Mapping)]
    if evals:
        stages.append(f"{len(evals)} evals in {_duration(sum(e.get('seconds', 0) for e in evals))}")
    root = results.get("root", "-")
    lines = [
        f"primeflow run {results.get('run', '?')}",
        "",
        *("  " + line for line in table),
        "",
        "  stages:   " + " · ".join(stages),
        f"  run root: {root}",
        "            manifest.json, rollouts/, checkpoints/, eval/, metrics.jsonl, logs/",
        f"  Prefect:  {ui_url}",
    ]
    if report.get("plot"):
        lines.insert(-1, f"  plot:     {report['plot']}")
    return "\n".join(lines)
