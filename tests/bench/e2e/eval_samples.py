"""A run's evaluations in a few lines each: every policy's summary and its first greedy and sampled
answers, as one JSON file small enough to bring back from the GPU machine, where a reward of
0.000 says nothing about what went wrong.

    python -m tests.bench.e2e.eval_samples RUN_FOLDER OUT.json [--answers 4]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pyarrow.ipc as ipc

#: The columns that tell what the policy did with a prompt.
COLUMNS = ("example_id", "mode", "reward", "is_truncated", "completion_tokens", "completion_text")


def evaluation(folder: Path, answers: int) -> dict[str, Any]:
    """The summary of one committed evaluation and its first `answers` answers per mode."""
    table = ipc.open_file(folder / "results.arrow").read_all()
    rows = table.select(["prompt_text", *COLUMNS]).to_pylist()
    shown: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        kept = shown.setdefault(row["mode"], [])
        if len(kept) < answers:
            kept.append(row)
    return {
        "summary": json.loads((folder / "summary.json").read_text()),
        "first_prompt": rows[0]["prompt_text"] if rows else None,
        "answers": {
            mode: [{k: r[k] for k in COLUMNS} for r in kept] for mode, kept in shown.items()
        },
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.e2e.eval_samples")
    parser.add_argument("run", type=Path, help="a run's local folder (holds eval/)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--answers", type=int, default=4)
    args = parser.parse_args(argv)
    found = {
        f"{step.parent.name}/{step.name}": evaluation(step, args.answers)
        for step in sorted(args.run.glob("eval/*/step_*"))
        if (step / "_COMMITTED").exists() and (step / "results.arrow").exists()
    }
    args.out.write_text(json.dumps(found, indent=1))
    return found


if __name__ == "__main__":
    main()
