"""What a finished (or running) run shows a person: a plot, eval noise and sample tables.

`write_run_report(store)` reads only what the run committed to its object store:

- metric lines (`storage.metrics.read_metrics`) of the stages `sft` (trainer loss, eval
  loss), `rl` (trainer loss, entropy, clip fractions), `orchestrator` (reward of each training
  batch, groups without advantage) and `eval-online` (held-out evaluations during RL);
- every evaluation's latest committed `eval/<name>/step_N/results.arrow`;

and writes, under `<run>/report/`:

- `reward.png`: reward (top) and loss and learning health (bottom) per optimizer step, SFT
  steps first and RL steps after them on one axis; evaluations are drawn where their policy
  sits on that axis (`base` at 0, `sft` at the end of SFT, any other name at the end of SFT +
  its checkpoint step) with error bars of one standard error, and the held-out evaluations
  made during RL as curves;
- `samples.md` / `samples.json`: the same held-out prompts answered by each evaluated policy
  (prompt, completion, reward), before and after;
- `report.json`: per evaluation and mode (sampled, greedy) the number of examples and samples,
  the mean reward and its standard error, plus paired differences between consecutive
  policies (same prompts, so the paired standard error is the honest noise of an improvement),
  and how much RL had to learn from (`rl_signal`).

Nothing here imports Prefect; the flow calls it and links the files.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

from engine.orchestrator.online_eval import ONLINE_EVAL_STAGE
from engine.orchestrator.step_metrics import ZERO_GROUP_FRACTION
from storage.commit import committed_steps
from storage.evals import RESULTS
from storage.layout import RunLayout
from storage.metrics import read_metrics
from storage.paths import join
from storage.store import ObjectStore

REPORT_DIR = "report"
PLOT = "reward.png"
SAMPLES_MD = "samples.md"
SAMPLES_JSON = "samples.json"
REPORT_JSON = "report.json"

#: Evaluations in the order a pipeline makes them; others follow in name order.
POLICY_ORDER = ("base", "sft", "rl")
_USER = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.DOTALL)
_END_TOKENS = ("<|im_end|>", "<|endoftext|>")


# ----------------------------------------------------------------------------- reading


def _ordered(names: Sequence[str]) -> list[str]:
    known = [name for name in POLICY_ORDER if name in names]
    return known + sorted(name for name in names if name not in POLICY_ORDER)


def latest_evals(store: ObjectStore) -> dict[str, tuple[int, pa.Table]]:
    """`{eval name: (step, results table)}` of each evaluation's newest committed step."""
    found: dict[str, tuple[int, pa.Table]] = {}
    for name in _ordered(store.list(RunLayout.EVAL)):
        steps = committed_steps(store, RunLayout.eval_parent(name))
        if not steps:
            continue
        step = steps[-1]
        data = store.read_bytes(join(RunLayout.eval_dir(name, step), RESULTS))
        found[name] = (step, ipc.open_file(pa.py_buffer(data)).read_all())
    return found


def _reward(value: Any) -> float:
    """Unscorable rollouts (NaN) count as 0, as avg@k counts them."""
    return 0.0 if value is None or (isinstance(value, float) and math.isnan(value)) else value


def _per_example(table: pa.Table, mode: str) -> dict[int, list[float]]:
    rewards: dict[int, list[float]] = {}
    for row in table.select(["example_id", "mode", "reward"]).to_pylist():
        if row["mode"] == mode:
            rewards.setdefault(row["example_id"], []).append(_reward(row["reward"]))
    return rewards


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan


def _stderr(values: Sequence[float]) -> float:
    """Standard error of the mean (sample std / sqrt n); NaN below two values."""
    if len(values) < 2:
        return math.nan
    mean = _mean(values)
    variance = math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return math.sqrt(variance / len(values))


def reward_stats(table: pa.Table, mode: str) -> dict[str, float | int] | None:
    """Mean reward of `mode` rows and its standard error over examples (k samples of one
    example are averaged first, since they are not independent)."""
    by_example = _per_example(table, mode)
    if not by_example:
        return None
    means = [_mean(v) for v in by_example.values()]
    return {
        "examples": len(by_example),
        "samples": sum(len(v) for v in by_example.values()),
        "mean": _mean([r for v in by_example.values() for r in v]),
        "stderr": _stderr(means),
    }


def paired_difference(after: pa.Table, before: pa.Table, mode: str) -> dict[str, float] | None:
    """Mean reward of `after` minus `before` over the examples both evaluated, with the
    standard error of the paired differences."""
    a, b = _per_example(after, mode), _per_example(before, mode)
    common = sorted(set(a) & set(b))
    if not common:
        return None
    diffs = [_mean(a[i]) - _mean(b[i]) for i in common]
    return {"examples": len(common), "mean": _mean(diffs), "stderr": _stderr(diffs)}


# ----------------------------------------------------------------------------- samples


def prompt_of(prompt_text: str) -> str:
    """The last user message of a ChatML-rendered prompt (the whole text otherwise)."""
    found = _USER.findall(prompt_text)
    return found[-1].strip() if found else prompt_text.strip()


def completion_of(text: str) -> str:
    for end in _END_TOKENS:
        text = text.replace(end, "")
    return text.strip()


def sample_rows(
    evals: Mapping[str, tuple[int, pa.Table]], num_examples: int, mode: str
) -> list[dict[str, Any]]:
    """The first `num_examples` held-out examples every policy answered, each policy's first
    `mode` completion with its reward."""
    firsts: dict[str, dict[int, dict[str, Any]]] = {}
    for name, (_, table) in evals.items():
        rows: dict[int, dict[str, Any]] = {}
        for row in table.to_pylist():
            if row["mode"] == mode and row["example_id"] not in rows:
                rows[row["example_id"]] = row
        firsts[name] = rows
    if not firsts:
        return []
    common = sorted(set.intersection(*(set(rows) for rows in firsts.values())))
    out = []
    for example in common[:num_examples]:
        first = next(iter(firsts.values()))[example]
        out.append(
            {
                "example_id": example,
                "prompt": prompt_of(first["prompt_text"]),
                "policies": {
                    name: {
                        "completion": completion_of(rows[example]["completion_text"]),
                        "reward": _reward(rows[example]["reward"]),
                    }
                    for name, rows in firsts.items()
                },
            }
        )
    return out


def _cell(text: str) -> str:
    """Markdown table cell as code, so tags such as `<reversed_text>` stay visible."""
    text = text.replace("\n", " ").replace("`", "'").replace("|", "\\|")
    return f"`{text}`" if text else "*(empty)*"


def samples_markdown(
    rows: Sequence[Mapping[str, Any]],
    stats: Mapping[str, Mapping[str, Any]],
    mode: str,
) -> str:
    lines = [f"# Held-out samples ({mode})", ""]
    if stats:
        lines += [
            "| policy | step | mode | examples | samples | mean reward | ± stderr |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, entry in stats.items():
            for which in ("sampled", "greedy"):
                value = entry.get(which)
                if value:
                    lines.append(
                        f"| {name} | {entry['step']} | {which} | {value['examples']} | "
                        f"{value['samples']} | {value['mean']:.3f} | {value['stderr']:.3f} |"
                    )
        lines.append("")
    lines += ["| example | prompt | policy | completion | reward |", "|---|---|---|---|---|"]
    for row in rows:
        for index, (name, answer) in enumerate(row["policies"].items()):
            head = f"{row['example_id']} | {_cell(row['prompt'])}" if index == 0 else " | "
            lines.append(
                f"| {head} | {name} | {_cell(answer['completion'])} | {answer['reward']:.2f} |"
            )
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- plot


def _series(
    lines: Sequence[Mapping[str, Any]], key: str, offset: int = 0
) -> tuple[list[int], list[float]]:
    xs: list[int] = []
    ys: list[float] = []
    for line in lines:
        value = line.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            xs.append(line["step"] + offset)
            ys.append(float(value))
    return xs, ys


def _moving_average(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        out.append(total / min(index + 1, window))
    return out


def _eval_position(name: str, step: int, sft_steps: int) -> int:
    if name == "base":
        return 0
    if name == "sft":
        return sft_steps
    return sft_steps + step


def _eval_points(
    stats: Mapping[str, Mapping[str, Any]], mode: str, sft_steps: int
) -> list[tuple[int, Mapping[str, Any], str]]:
    return [
        (_eval_position(name, entry["step"], sft_steps), entry[mode], name)
        for name, entry in stats.items()
        if entry.get(mode)
    ]


_EVAL_STYLES = {"sampled": ("o", "tab:red"), "greedy": ("s", "tab:green")}


def _draw_evals(
    ax: Any,
    stats: Mapping[str, Mapping[str, Any]],
    sft_steps: int,
    shift: int = 0,
    annotate: bool = False,
) -> None:
    """Eval means ± one standard error; labels above the higher point of a policy, below the
    lower one, so they never overlap."""
    points = {mode: _eval_points(stats, mode, sft_steps) for mode in _EVAL_STYLES}
    for mode, (marker, color) in _EVAL_STYLES.items():
        if not points[mode]:
            continue
        ax.errorbar(
            [x - shift for x, _, _ in points[mode]],
            [value["mean"] for _, value, _ in points[mode]],
            yerr=[0.0 if math.isnan(v["stderr"]) else v["stderr"] for _, v, _ in points[mode]],
            fmt=marker,
            color=color,
            capsize=4,
            markersize=7,
            label=f"held-out eval, {mode} (± stderr)",
        )
    if not annotate:
        return
    by_policy: dict[str, list[tuple[str, int, float]]] = {}
    for mode, entries in points.items():
        for x, value, name in entries:
            by_policy.setdefault(name, []).append((mode, x - shift, value["mean"]))
    for name, marks in by_policy.items():
        marks.sort(key=lambda mark: mark[2])
        for rank, (mode, x, mean) in enumerate(marks):
            above = rank == len(marks) - 1
            ax.annotate(
                f"{name} {mean:.3f}",
                (x, mean),
                textcoords="offset points",
                xytext=(6, 6 if above else -13),
                fontsize=8,
                color=_EVAL_STYLES[mode][1],
            )


def _draw_online_evals(ax: Any, lines: Sequence[Mapping[str, Any]]) -> None:
    """The held-out evaluations made during RL (`eval.interval`), one point per version."""
    sampled_key = next((k for line in lines for k in line if k.startswith("eval/avg@")), None)
    for key, color, label in (
        ("eval/greedy/avg@1", "tab:green", "held-out greedy during RL"),
        (sampled_key, "tab:red", "held-out sampled during RL"),
    ):
        xs, ys = _series(lines, key) if key else ([], [])
        if xs:
            ax.plot(xs, ys, ".-", color=color, alpha=0.7, linewidth=1, label=label)


def _draw_health(ax: Any, metrics: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
    """Whether RL can still learn: the policy's entropy (left axis), and the shares of
    groups with no advantage, of tokens the loss clipped or capped, and of tokens sampled by
    weights older than those trained (right axis)."""
    ax.grid(alpha=0.3)
    ax.set_title("RL learning health", fontsize=10)
    ax.set_xlabel("RL step")
    xs, ys = _series(metrics.get("rl", []), "entropy")
    handles = ax.plot(xs, ys, color="tab:brown", linewidth=1.2, label="entropy (nats/token)")
    ax.set_ylabel("entropy")
    shares = ax.twinx()
    shares.set_ylabel("share")
    shares.set_ylim(-0.02, 1.02)
    for stage, key, color in (
        ("orchestrator", ZERO_GROUP_FRACTION, "tab:gray"),
        ("rl", "capped_fraction", "tab:olive"),
        ("rl", "clip_low_fraction", "tab:cyan"),
        ("rl", "clip_high_fraction", "tab:pink"),
        ("rl", "masked_fraction", "tab:olive"),
        ("rl", "stale_token_fraction", "tab:purple"),
    ):
        xs, ys = _series(metrics.get(stage, []), key)
        if xs:
            handles += shares.plot(xs, ys, color=color, linewidth=1, alpha=0.8, label=key)
    if xs or handles:
        ax.legend(handles=handles, loc="upper right", fontsize=7)


def reward_figure(
    metrics: Mapping[str, Sequence[Mapping[str, Any]]],
    stats: Mapping[str, Mapping[str, Any]],
    sft_steps: int,
    title: str,
) -> Any:
    """The reward/loss figure (a matplotlib `Figure` on the Agg canvas; no global backend).

    Top left: reward over every step (SFT shaded, then RL). Top right: the RL steps alone, so
    a small RL gain is visible next to a long SFT, with the held-out evaluations made during
    RL. Bottom left: SFT loss and RL loss; bottom right: RL's learning health.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 7.5), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplot_mosaic([["all", "rl"], ["loss", "health"]], width_ratios=[3, 2])
    reward_ax, zoom_ax, loss_ax = axes["all"], axes["rl"], axes["loss"]
    for ax in (reward_ax, loss_ax):
        if sft_steps:
            ax.axvspan(0, sft_steps, color="0.93", zorder=0)
            ax.axvline(sft_steps, color="0.6", linewidth=0.8, zorder=1)
    for ax in (reward_ax, zoom_ax, loss_ax):
        ax.grid(alpha=0.3)
    figure.suptitle(title)

    xs, ys = _series(metrics.get("orchestrator", []), "reward/mean")
    for ax, shift in ((reward_ax, sft_steps), (zoom_ax, 0)):
        if xs:
            ax.plot([x + shift for x in xs], ys, color="tab:blue", alpha=0.35, linewidth=1)
            ax.plot(
                [x + shift for x in xs],
                _moving_average(ys, 5),
                color="tab:blue",
                linewidth=2,
                label="RL training batches (5-step average)",
            )
    _draw_evals(reward_ax, stats, sft_steps)
    _draw_online_evals(zoom_ax, metrics.get(ONLINE_EVAL_STAGE, []))
    _draw_health(axes["health"], metrics)
    rl_stats = {name: entry for name, entry in stats.items() if name != "base"}
    _draw_evals(zoom_ax, rl_stats, sft_steps, shift=sft_steps, annotate=True)
    reward_ax.set_ylabel("reward")
    reward_ax.set_ylim(-0.02, 1.02)
    reward_ax.set_xlabel(f"step (SFT 1-{sft_steps} shaded, then RL)" if sft_steps else "RL step")
    zoom_ax.set_xlabel("RL step (SFT result at 0)")
    zoom_ax.set_title("RL steps", fontsize=10)
    for ax in (reward_ax, zoom_ax):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right", fontsize=7)

    xs, ys = _series(metrics.get("sft", []), "loss")
    if xs:
        loss_ax.plot(xs, ys, color="tab:purple", linewidth=1.2, label="SFT train loss (NLL)")
    xs, ys = _series(metrics.get("sft", []), "eval_loss")
    if xs:
        loss_ax.plot(xs, ys, "D", color="tab:purple", markersize=4, label="SFT held-out loss")
    loss_ax.set_ylabel("SFT loss (NLL per token)")
    handles, labels = loss_ax.get_legend_handles_labels()
    xs, ys = _series(metrics.get("rl", []), "loss", sft_steps)
    if xs:
        rl_ax = loss_ax.twinx()
        rl_ax.plot(xs, ys, color="tab:orange", linewidth=1.2, label="RL loss")
        rl_ax.set_ylabel("RL loss")
        more_handles, more_labels = rl_ax.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    if handles:
        loss_ax.legend(handles, labels, loc="upper center", fontsize=8)
    loss_ax.set_xlabel(f"step (SFT 1-{sft_steps} shaded, then RL)" if sft_steps else "RL step")
    return figure


def plot_png(
    metrics: Mapping[str, Sequence[Mapping[str, Any]]],
    stats: Mapping[str, Mapping[str, Any]],
    sft_steps: int,
    title: str,
) -> bytes:
    """`reward_figure` as PNG bytes."""
    buffer = io.BytesIO()
    reward_figure(metrics, stats, sft_steps, title).savefig(buffer, format="png")
    return buffer.getvalue()


def rl_signal(lines: Sequence[Mapping[str, Any]]) -> dict[str, float | int] | None:
    """How much RL had to learn from, over the orchestrator's committed steps: the share of
    groups whose rollouts did not all score alike (only those carry an advantage) and the
    steps where none did (their updates were skipped). None before any RL step. A run whose
    policy never earns a reward shows 0 here and nowhere else but in its flat curves."""
    shares = [line[ZERO_GROUP_FRACTION] for line in lines if ZERO_GROUP_FRACTION in line]
    if not shares:
        return None
    return {
        "steps": len(shares),
        "groups_with_advantage": 1.0 - _mean(shares),
        "steps_without": sum(share >= 1.0 for share in shares),
    }


# ----------------------------------------------------------------------------- entry point


def write_run_report(
    store: ObjectStore, *, num_samples: int = 5, mode: str = "sampled", title: str | None = None
) -> dict[str, Any]:
    """Write `<run>/report/` (plot, sample tables, eval statistics) for the run rooted at
    `store`; return what a summary needs: the files' URIs and the eval statistics.

    Works on any run state: missing stages are simply left out. Returns
    `{"plot": uri, "samples_md": uri, "samples_json": uri, "report": uri,
      "evals": {name: {"step", "sampled": {examples, samples, mean, stderr}, "greedy": ...}},
      "differences": {"sft-base": {"sampled": {examples, mean, stderr}, ...}, ...},
      "rl_signal": {"steps", "groups_with_advantage", "steps_without"} or None}`.
    """
    stages = ("sft", "rl", "orchestrator", ONLINE_EVAL_STAGE)
    metrics = {stage: read_metrics(store, stage) for stage in stages}
    sft_steps = max((line["step"] for line in metrics["sft"]), default=0)
    evals = latest_evals(store)
    stats: dict[str, dict[str, Any]] = {}
    for name, (step, table) in evals.items():
        stats[name] = {
            "step": step,
            "sampled": reward_stats(table, "sampled"),
            "greedy": reward_stats(table, "greedy"),
        }
    names = list(evals)
    differences = {}
    for before, after in itertools.pairwise(names):
        differences[f"{after}-{before}"] = {
            which: paired_difference(evals[after][1], evals[before][1], which)
            for which in ("sampled", "greedy")
        }
    signal = rl_signal(metrics["orchestrator"])
    rows = sample_rows(evals, num_samples, mode)
    run_name = store.url().rstrip("/").rsplit("/", 1)[-1]
    png = plot_png(metrics, stats, sft_steps, title or f"primeflow run {run_name}")
    documents = {
        PLOT: png,
        SAMPLES_MD: samples_markdown(rows, stats, mode).encode(),
        SAMPLES_JSON: (json.dumps(rows, indent=2) + "\n").encode(),
        REPORT_JSON: (
            json.dumps(
                {
                    "sft_steps": sft_steps,
                    "evals": stats,
                    "differences": differences,
                    "rl_signal": signal,
                },
                indent=2,
                sort_keys=True,
            )
            + "\n"
        ).encode(),
    }
    for file, data in documents.items():
        store.write_bytes(join(REPORT_DIR, file), data)
    return {
        "plot": store.url(join(REPORT_DIR, PLOT)),
        "samples_md": store.url(join(REPORT_DIR, SAMPLES_MD)),
        "samples_json": store.url(join(REPORT_DIR, SAMPLES_JSON)),
        "report": store.url(join(REPORT_DIR, REPORT_JSON)),
        "evals": stats,
        "differences": differences,
        "rl_signal": signal,
    }
