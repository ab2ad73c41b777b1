"""Run names and the paths inside a run."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from storage.layout import RunLayout, run_uri, validate_run_name

_NAME_CHARS = "abcxyzABCXYZ0123456789._-"
_valid_names = st.builds(
    lambda first, rest: first + rest,
    st.sampled_from("aZ09"),
    st.text(st.sampled_from(_NAME_CHARS), max_size=127),
).filter(lambda name: ".." not in name)


@given(_valid_names)
def test_valid_run_names_pass_unchanged(name: str) -> None:
    assert validate_run_name(name) == name
    assert run_uri("file://./runs", name) == f"file://./runs/{name}"


@given(st.text(min_size=1, max_size=130))
def test_any_accepted_name_is_one_safe_folder(name: str) -> None:
    try:
        validate_run_name(name)
    except ValueError:
        return
    assert len(name) <= 128
    assert name[0].isascii() and name[0].isalnum()
    assert set(name) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
    assert ".." not in name


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("", "empty"),
        ("a" * 129, "129 characters"),
        ("my run", "whitespace"),
        ("a\tb", "whitespace"),
        ("a/b", "'/'"),
        ("a..b", "'..'"),
        (".hidden", "start with a letter or a digit"),
        ("-x", "start with a letter or a digit"),
        ("ünïcode", "start with a letter or a digit"),
        ("run$1", "'$'"),
    ],
)
def test_bad_run_names_say_what_is_wrong(name: str, problem: str) -> None:
    with pytest.raises(ValueError, match="run name") as info:
        validate_run_name(name)
    assert problem in str(info.value)


def test_run_uri_joins_once() -> None:
    assert run_uri("s3://bucket/prefix/", "r1") == "s3://bucket/prefix/r1"
    with pytest.raises(ValueError, match="unsupported"):
        run_uri("ftp://host", "r1")


def test_paths_inside_a_run() -> None:
    assert RunLayout.MANIFEST == "manifest.json"
    assert RunLayout.METRICS == "metrics.jsonl"
    assert RunLayout.LOGS == "logs"
    assert RunLayout.rollouts_dir(42) == "rollouts/step_000042"
    assert RunLayout.checkpoint_dir(0) == "checkpoints/step_000000"
    assert RunLayout.eval_dir("gsm8k", 7) == "eval/gsm8k/step_000007"
    assert RunLayout.step_name(1_234_567) == "step_1234567"
    with pytest.raises(ValueError, match="eval name"):
        RunLayout.eval_dir("../x", 1)


@given(st.integers(min_value=0, max_value=10**12))
def test_step_names_round_trip(step: int) -> None:
    assert RunLayout.parse_step(RunLayout.step_name(step)) == step


@pytest.mark.parametrize("name", ["step_42", "step_0000042", "step_-00001", "x_000001", "step_"])
def test_foreign_folder_names_are_not_steps(name: str) -> None:
    assert RunLayout.parse_step(name) is None


@pytest.mark.parametrize("step", [-1, 1.0, True, "3"])
def test_steps_are_non_negative_ints(step: object) -> None:
    with pytest.raises((ValueError, TypeError)):
        RunLayout.step_name(step)  # type: ignore[arg-type]


def test_the_commit_log_sits_beside_the_folder_it_logs() -> None:
    entry = RunLayout.commit_log_entry("checkpoints", 42)
    assert entry == "commit_log/checkpoints/step_000042.json"
    # The SFT stage's writer is rooted at `sft/`; the run's monitor names `sft/checkpoints`.
    assert RunLayout.commit_log_dir("sft/checkpoints") == "sft/commit_log/checkpoints"
    assert RunLayout.announced_entry("checkpoints", 42) == "announced/checkpoints/step_000042.json"
    assert RunLayout.announced_dir("sft/checkpoints") == "sft/announced/checkpoints"


def test_each_stage_has_its_store_below_the_run_root(memory_store) -> None:
    from engine.run import stage_store

    assert stage_store(memory_store, "rl").url() == memory_store.url()
    assert stage_store(memory_store, "sft").url() == memory_store.url("sft")
    assert RunLayout.stage_checkpoints("sft") == "sft/checkpoints"
    assert RunLayout.stage_checkpoints("rl") == "checkpoints"
