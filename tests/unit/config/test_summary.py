"""The terminal summary of a pipeline run."""

from __future__ import annotations

from flows.summary import render


def test_summary_lists_each_policy_stage_times_and_locations() -> None:
    results = {
        "run": "demo",
        "root": "file:///runs/demo",
        "eval_base": {
            "avg@1": 0.05,
            "greedy/avg@1": 0.01,
            "samples": 200,
            "uri": "u0",
            "seconds": 40,
        },
        "sft": {"last_step": 300, "seconds": 125.0},
        "eval_sft": {
            "avg@1": 0.55,
            "greedy/avg@1": 0.6,
            "samples": 200,
            "uri": "u1",
            "seconds": 30,
        },
        "rl": {"last_step": 100, "seconds": 400.0},
        "eval_rl": {"avg@1": 0.61, "greedy/avg@1": 0.7, "samples": 200, "uri": "u2", "seconds": 31},
        "report": {"evals": {"rl": {"sampled": {"stderr": 0.02}}}, "plot": "file:///r/reward.png"},
    }
    text = render(results, k=1, temperature=1.0, ui_url="http://127.0.0.1:4200/runs/flow-run/x")
    rows = {line.split()[0]: line.split() for line in text.splitlines()[3:6]}
    assert rows["base"][1:4] == ["0.050", "0.010", "200"]
    assert rows["rl"][1:7] == ["0.610", "±", "0.020", "0.700", "200", "u2"]
    assert "sft 300 steps in 2m05s" in text and "rl 100 steps in 6m40s" in text
    assert "3 evals in 1m41s" in text
    assert "plot:     file:///r/reward.png" in text
    assert "file:///runs/demo" in text and "http://127.0.0.1:4200/runs/flow-run/x" in text
    assert all(line == line.rstrip() for line in text.splitlines())
