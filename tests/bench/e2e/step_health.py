"""An RL run's health step by step, and what its policy wrote, as one text file small enough to
bring back from the GPU machine: where a collapse starts shows in no mean over the run.

One line per RL step (training reward, truncated share, groups without advantage | entropy,
trainer-inference mismatch KL on all samples, on those of the weights being trained and on
older ones, the oldest sample's lag, importance ratio, gradient norm, skipped update), then the
first `--rollouts` training rollouts of a few steps, each with its reward, advantage and the end
of its completion. The agentic examples' collapse on the GPU model was found with it: their
calls broke within 16 steps while the training reward was still flat (docs/benchmarks.md).

    python -m tests.bench.e2e.step_health RUN_FOLDER OUT.txt [--every 20] [--rollouts 4]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from storage.commit import committed_steps
from storage.layout import RunLayout
from storage.metrics import read_metrics
from storage.shards import read_rollouts
from storage.store import ObjectStore

#: (stage, key) of each column, in the order printed.
COLUMNS = (
    ("orchestrator", "reward/mean"),
    ("orchestrator", "truncated/rate"),
    ("orchestrator", "advantage/zero_group_fraction"),
    ("rl", "entropy"),
    ("rl", "mismatch_kl"),
    ("rl", "mismatch_kl_fresh"),
    ("rl", "mismatch_kl_stale"),
    ("rl", "policy_lag_max"),
    ("rl", "ratio"),
    ("rl", "grad_norm"),
    ("rl", "skipped"),
)
#: The last characters of a completion shown.
TAIL = 300


def _cell(line: dict[str, Any], key: str) -> str:
    value = line.get(key)
    return f"{value:.4f}" if isinstance(value, int | float) else "-"


def step_lines(store: ObjectStore) -> list[str]:
    """The header and one line per step the trainer committed a metric line for."""
    stages = {stage: {line["step"]: line for line in read_metrics(store, stage)} for stage in
              ("orchestrator", "rl")}  # fmt: skip
    lines = ["step " + " ".join(key for _, key in COLUMNS)]
    for step in sorted(stages["rl"]):
        cells = [_cell(stages[stage].get(step, {}), key) for stage, key in COLUMNS]
        lines.append(f"{step} " + " ".join(cells))
    return lines


def rollout_lines(store: ObjectStore, every: int, count: int) -> list[str]:
    """The first `count` rollouts of step 1 and of every `every`-th committed step."""
    lines = []
    steps = committed_steps(store, RunLayout.ROLLOUTS)
    for step in [s for s in steps if s == 1 or s % every == 0]:
        rows = read_rollouts(store, step).slice(0, count).to_pylist()
        lines.append(f"-- rollouts of step {step}")
        for row in rows:
            lines.append(
                f"   reward {row['reward']:.3f} advantage {row['advantage']:.3f} "
                f"truncated {row['is_truncated']}: {row['completion_text'][-TAIL:]!r}"
            )
    return lines


def health_text(store: ObjectStore, every: int = 20, rollouts: int = 4) -> str:
    """The per-step lines, then the rollouts of every `every`-th step, as one text."""
    return "\n".join([*step_lines(store), *rollout_lines(store, every, rollouts)]) + "\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.e2e.step_health")
    parser.add_argument("run", type=Path, help="a run's local folder (holds metrics/, rollouts/)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--every", type=int, default=20, help="show rollouts of every Nth step")
    parser.add_argument("--rollouts", type=int, default=4, help="rollouts shown per step")
    args = parser.parse_args(argv)
    store = ObjectStore(f"file://{args.run.resolve()}")
    text = health_text(store, args.every, args.rollouts)
    args.out.write_text(text)
    return text


if __name__ == "__main__":
    main()
