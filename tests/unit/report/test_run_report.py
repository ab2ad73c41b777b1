"""The run report: plot, eval statistics and sample tables from what a run committed."""

from __future__ import annotations

import json
import math
import uuid

import pytest

from engine.orchestrator.online_eval import ONLINE_EVAL_STAGE
from engine.report import write_run_report
from engine.report.run_report import completion_of, prompt_of, reward_figure
from storage.evals import write_eval
from storage.metrics import write_metrics
from storage.store import ObjectStore

PROMPT = (
    "<|im_start|>system\nReverse the text.<|im_end|>\n"
    "<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
)


def _row(example: int, mode: str, sample: int, reward: float, text: str) -> dict:
    return {
        "env": "reverse-text",
        "example_id": example,
        "mode": mode,
        "sample": sample,
        "reward": reward,
        "passed": reward >= 0.99,
        "skip_reason": None if not math.isnan(reward) else "no_completion",
        "error": None,
        "policy_version": 0,
        "policy_lineage": "",
        "temperature": 1.0 if mode == "sampled" else 0.0,
        "completion_tokens": len(text),
        "is_truncated": False,
        "prompt_text": PROMPT.format(text=f"text {example}"),
        "completion_text": f"{text}<|im_end|>",
        "metrics": {},
    }


def _eval(store: ObjectStore, name: str, step: int, rewards: list[list[float]]) -> None:
    """`rewards[example]` = the k sampled rewards; greedy is the first one."""
    rows = []
    for example, values in enumerate(rewards):
        for sample, reward in enumerate(values):
            rows.append(_row(example, "sampled", sample, reward, f"{name} answer {example}"))
        rows.append(_row(example, "greedy", 0, values[0], f"{name} greedy {example}"))
    write_eval(store, name, step, rows, {"name": name, "step": step})


@pytest.fixture
def store() -> ObjectStore:
    store = ObjectStore(f"memory://report-{uuid.uuid4().hex}/run-a")
    for step in range(1, 11):
        eval_loss = 2.0 if step == 10 else None
        write_metrics(store, "sft", step, {"loss": 3.0 / step, "eval_loss": eval_loss})
    for step in range(1, 6):
        write_metrics(store, "rl", step, {"loss": 0.01 * step})
        write_metrics(store, "orchestrator", step, {"reward/mean": 0.5 + 0.02 * step})
    _eval(store, "base", 0, [[0.0, 0.1], [0.2, math.nan], [0.1, 0.1]])
    _eval(store, "sft", 0, [[0.5, 0.7], [0.6, 0.6], [0.4, 0.5]])
    _eval(store, "rl", 5, [[0.7, 0.9], [0.8, 0.7], [0.6, 0.6]])
    return store


def test_writes_plot_tables_and_statistics(store: ObjectStore) -> None:
    report = write_run_report(store, num_samples=2)
    png = store.read_bytes("report/reward.png")
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    assert report["plot"] == store.url("report/reward.png")

    assert list(report["evals"]) == ["base", "sft", "rl"]
    base = report["evals"]["base"]["sampled"]
    # The NaN (unscorable) rollout counts as 0, as avg@k counts it.
    assert base["examples"] == 3 and base["samples"] == 6
    assert base["mean"] == pytest.approx(0.5 / 6)
    # Standard error over per-example means (0.05, 0.1, 0.1): std 0.0289 / sqrt(3).
    assert base["stderr"] == pytest.approx(0.028867513 / math.sqrt(3))
    assert report["evals"]["rl"]["step"] == 5
    assert report["evals"]["rl"]["greedy"]["samples"] == 3

    difference = report["differences"]["rl-sft"]["sampled"]
    assert difference["examples"] == 3
    assert difference["mean"] == pytest.approx((0.2 + 0.15 + 0.15) / 3)
    assert set(report["differences"]) == {"sft-base", "rl-sft"}
    assert json.loads(store.read_bytes("report/report.json"))["sft_steps"] == 10


def test_the_report_says_how_much_rl_had_to_learn_from(store: ObjectStore) -> None:
    assert write_run_report(store)["rl_signal"] is None  # lines from before the metric existed
    for step, zero in enumerate((0.5, 1.0, 1.0, 0.25), start=6):
        write_metrics(store, "orchestrator", step, {"advantage/zero_group_fraction": zero})
    signal = write_run_report(store)["rl_signal"]
    assert signal == {"steps": 4, "groups_with_advantage": 0.3125, "steps_without": 2}
    assert json.loads(store.read_bytes("report/report.json"))["rl_signal"] == signal


def test_sample_tables_show_each_policy_on_the_same_prompts(store: ObjectStore) -> None:
    write_run_report(store, num_samples=2)
    rows = json.loads(store.read_bytes("report/samples.json"))
    assert [row["example_id"] for row in rows] == [0, 1]
    assert rows[0]["prompt"] == "text 0"
    assert rows[0]["policies"]["rl"] == {"completion": "rl answer 0", "reward": 0.7}
    assert list(rows[1]["policies"]) == ["base", "sft", "rl"]
    assert rows[1]["policies"]["base"]["reward"] == 0.2
    markdown = store.read_bytes("report/samples.md").decode()
    assert "| rl | 5 | sampled | 3 | 6 |" in markdown
    assert "`rl answer 1`" in markdown and "`text 1`" in markdown


def test_the_plot_draws_online_evaluations_and_learning_health() -> None:
    rl = [
        {
            "step": s,
            "loss": 0.1,
            "entropy": 0.5 - 0.05 * s,
            "capped_fraction": 0.01,
            "stale_token_fraction": 0.0 if s == 1 else 0.75,
        }
        for s in (1, 2, 3)
    ]
    orchestrator = [
        {"step": s, "reward/mean": 0.5, "advantage/zero_group_fraction": 0.25} for s in (1, 2, 3)
    ]
    online = [
        {"step": s, "eval/greedy/avg@1": 0.5 + 0.1 * s, "eval/avg@2": 0.4 + 0.1 * s} for s in (0, 2)
    ]
    metrics = {"rl": rl, "orchestrator": orchestrator, ONLINE_EVAL_STAGE: online}
    figure = reward_figure(metrics, {}, 0, "run")
    curves = {
        line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
        for ax in figure.axes
        for line in ax.get_lines()
    }
    assert curves["held-out greedy during RL"] == ([0, 2], [0.5, 0.7])
    assert curves["held-out sampled during RL"][1] == pytest.approx([0.4, 0.6])
    assert curves["entropy (nats/token)"][1] == pytest.approx([0.45, 0.4, 0.35])
    assert curves["advantage/zero_group_fraction"] == ([1, 2, 3], [0.25] * 3)
    assert curves["capped_fraction"][1] == [0.01] * 3
    assert curves["stale_token_fraction"] == ([1, 2, 3], [0.0, 0.75, 0.75])


def test_a_run_without_evaluations_still_gets_a_plot() -> None:
    store = ObjectStore(f"memory://report-{uuid.uuid4().hex}/run-b")
    write_metrics(store, "sft", 1, {"loss": 2.0})
    report = write_run_report(store)
    assert report["evals"] == {} and report["differences"] == {}
    assert store.read_bytes("report/reward.png").startswith(b"\x89PNG")
    assert json.loads(store.read_bytes("report/samples.json")) == []


def test_chatml_helpers() -> None:
    assert prompt_of(PROMPT.format(text="a b")) == "a b"
    assert prompt_of("plain") == "plain"
    assert completion_of("<reversed_text>x</reversed_text><|im_end|>") == (
        "<reversed_text>x</reversed_text>"
    )
