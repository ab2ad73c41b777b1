"""The terminal summary of a pipeline run."""

from __future__ import annotations

from engine.results import EvalResult, PipelineResult, RunReport, StageResult
from flows.summary import render


def _eval(name: str, reward: float, greedy: float, uri: str, seconds: float) -> EvalResult:
    metrics = {"avg@1": reward, "greedy/avg@1": greedy}
    return EvalResult(name, 0, uri, samples=200, seconds=seconds, metrics=metrics)


def test_summary_lists_each_policy_stage_times_and_locations() -> None:
    results = PipelineResult(
        run="demo",
        root="file:///runs/demo",
        eval_base=_eval("base", 0.05, 0.01, "u0", 40),
        sft=StageResult("sft", 300, 300, "file:///runs/demo/sft/step_300", 125.0),
        eval_sft=_eval("sft", 0.55, 0.6, "u1", 30),
        rl=StageResult("rl", 100, 100, "file:///runs/demo/checkpoints/step_100", 400.0),
        eval_rl=_eval("rl", 0.61, 0.7, "u2", 31),
        report=RunReport.from_report(
            {
                "plot": "file:///r/reward.png",
                "samples_md": "s",
                "report": "r",
                "evals": {"rl": {"sampled": {"stderr": 0.02}}},
                "differences": {
                    "sft-base": {"sampled": None, "greedy": None},
                    "rl-sft": {
                        "sampled": {"examples": 200, "mean": 0.0612, "stderr": 0.0104},
                        "greedy": {"examples": 200, "mean": -0.004, "stderr": 0.009},
                    },
                },
                "rl_signal": {"steps": 100, "groups_with_advantage": 0.4125, "steps_without": 3},
            }
        ),
    )
    text = render(results, k=1, temperature=1.0, ui_url="http://127.0.0.1:4200/runs/flow-run/x")
    rows = {line.split()[0]: line.split() for line in text.splitlines()[3:6]}
    assert rows["base"][1:4] == ["0.050", "0.010", "200"]
    assert rows["rl"][1:7] == ["0.610", "±", "0.020", "0.700", "200", "u2"]
    assert "sft 300 steps in 2m05s" in text and "rl 100 steps in 6m40s" in text
    assert "3 evals in 1m41s" in text
    # The gain of RL over SFT on the same prompts; a pair with no common prompts has no line.
    gain = "gain:     rl − sft: +0.061 ± 0.010 sampled, -0.004 ± 0.009 greedy (paired, 200 prompts)"
    assert gain in text and "sft − base" not in text
    assert "signal:   41% of RL's groups had an advantage; 3 of 100 steps had none\n" in text
    assert "plot:     file:///r/reward.png" in text
    assert "file:///runs/demo" in text and "http://127.0.0.1:4200/runs/flow-run/x" in text
    assert all(line == line.rstrip() for line in text.splitlines())


def test_a_run_whose_groups_all_scored_alike_is_told_why_rl_did_not_move() -> None:
    """corpus-search on the GPU model: every group tied at reward 0 for 80 steps, and the table
    alone showed only flat rewards."""
    report = {"plot": "p", "samples_md": "s", "report": "r"}
    quiet = {"steps": 80, "groups_with_advantage": 0.004, "steps_without": 74}
    line = RunReport.from_report({**report, "rl_signal": quiet}).signal_line()
    assert line is not None and line.startswith("0% of RL's groups had an advantage; 74 of 80")
    assert "scored alike, so RL had next to nothing to learn from" in line
    assert RunReport.from_report({**report, "rl_signal": None}).signal_line() is None


def test_an_evaluation_reads_its_headline_numbers_from_its_summary() -> None:
    summary = {
        "name": "rl", "step": 7, "avg@2": 0.5, "pass@2": 0.75, "greedy/avg@1": 0.25,
        "envs": {"a": {"samples": 6}, "b": {"samples": 4}},
    }  # fmt: skip
    result = EvalResult.from_summary("rl", "file:///e", summary, seconds=2.0)
    assert result.step == 7 and result.samples == 10 and result.uri == "file:///e"
    assert result.metrics == {"avg@2": 0.5, "pass@2": 0.75, "greedy/avg@1": 0.25}


def test_results_persist_as_json_and_read_back_typed() -> None:
    """The CLI persists flow results with Prefect's JSON serializer: no pickle in storage."""
    from prefect.serializers import JSONSerializer

    results = PipelineResult(
        run="demo",
        root="file:///runs/demo",
        eval_base=_eval("base", 0.05, 0.01, "u0", 40),
        rl=StageResult("rl", 3, 3, "file:///runs/demo/checkpoints/step_3", 12.5),
    )
    serializer = JSONSerializer()
    back = serializer.loads(serializer.dumps(results))
    assert back == results and isinstance(back.rl, StageResult)
