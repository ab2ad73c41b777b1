"""The orchestrator against a real vLLM CPU server: committed shards that are token-exact.

Every row must decode to the chat-templated prompt followed by what the server sampled, carry one
inference log-prob per sampled token, and mask exactly the sampled tokens; multi-turn rows keep
the environment's turns in place, unmasked.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file
from transformers import AutoTokenizer, GenerationConfig

from engine.config import PrimeflowConfig
from engine.config.orchestrator import EnvConfig
from engine.envs import load_environment
from engine.inference.pool import InferencePool
from engine.orchestrator.async_bound import min_policy_version
from engine.orchestrator.filter_watch import FilteredOutError
from engine.orchestrator.main import run_orchestrator
from engine.orchestrator.online_eval import ONLINE_EVAL_STAGE
from engine.orchestrator.signal_watch import RewardCollapsedError
from engine.orchestrator.skips import EnvironmentSkippedError
from engine.run import run_store
from storage.checkpoints import write_checkpoint
from storage.commit import committed_steps, wait_for_step
from storage.layout import RunLayout
from storage.metrics import read_metrics
from storage.shards import read_rollouts

pytestmark = pytest.mark.integration


def spans(mask: list[bool]) -> list[tuple[int, int, bool]]:
    """Runs of equal mask values as (start, end, value)."""
    out: list[tuple[int, int, bool]] = []
    start = 0
    for index in range(1, len(mask) + 1):
        if index == len(mask) or mask[index] != mask[start]:
            out.append((start, index, mask[start]))
            start = index
    return out


def check_token_columns(row: dict[str, Any]) -> None:
    """One log-prob per sampled token, zero elsewhere; masks on sampled tokens only."""
    ids, mask, logprobs = row["token_ids"], row["loss_mask"], row["logprobs"]
    assert len(ids) == len(mask) == len(logprobs)
    assert not mask[0] and any(mask)
    for sampled, logprob in zip(mask, logprobs, strict=True):
        assert logprob <= 0.0
        if not sampled:
            assert logprob == 0.0


def rows_of(config: PrimeflowConfig, step: int) -> list[dict[str, Any]]:
    return read_rollouts(run_store(config), step).to_pylist()


def test_reverse_text_steps_commit_token_exact_shards(
    pool: InferencePool, make_config: Callable[..., PrimeflowConfig], tiny_model: Path
) -> None:
    env_config = EnvConfig(id="reverse-text", args={"num_train_examples": 64})
    config = make_config(max_steps=3, orchestrator={"envs": [env_config], "max_async_level": 2})
    assert run_orchestrator(config, pool) == 0

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    # The server stops on every id the model's generation config lists (end of turn and text).
    stop_ids = set(GenerationConfig.from_pretrained(tiny_model).eos_token_id)
    tasks = load_environment(env_config).tasks("train")
    for step in (1, 2, 3):
        rows = rows_of(config, step)
        assert len(rows) >= 8
        groups: dict[int, list[dict]] = {}
        for row in rows:
            groups.setdefault(row["group_id"], []).append(row)
            assert (row["step"], row["env"], row["policy_version"]) == (step, "reverse-text", 0)
            check_token_columns(row)
            (_, (completion_start, end, sampled)) = spans(row["loss_mask"])
            assert sampled and end == len(row["token_ids"])  # one turn: prompt, then samples
            expected_prompt = tokenizer.apply_chat_template(
                tasks[row["example_id"]].prompt, add_generation_prompt=True, tokenize=False
            )
            ids = row["token_ids"]
            assert tokenizer.decode(ids[:completion_start]) == expected_prompt
            assert row["prompt_text"] + row["completion_text"] == tokenizer.decode(ids)
            assert row["temperature"] == 1.0
            truncated = len(ids) - completion_start == 24 and ids[-1] not in stop_ids
            assert row["is_truncated"] == truncated
        for members in groups.values():
            assert len(members) == 4 and len({m["example_id"] for m in members}) == 1
            assert abs(sum(m["advantage"] for m in members)) < 1e-5
    lines = read_metrics(run_store(config), "orchestrator")
    assert [line["step"] for line in lines] == [1, 2, 3]
    for line in lines:
        assert line["samples"] >= 8 and line["throughput/samples_per_s"] > 0
        assert 0.0 <= line["reward/reverse-text/mean"] <= 1.0
        assert line["count/stale/async_bound"] == 0


def test_multi_turn_alphabet_sort_keeps_environment_turns_unmasked(
    pool: InferencePool, make_config: Callable[..., PrimeflowConfig], tiny_model: Path
) -> None:
    env_config = EnvConfig(id="alphabet-sort", args={"num_train_examples": 32, "num_turns": 2})
    config = make_config(orchestrator={"envs": [env_config], "max_async_level": 1})
    assert run_orchestrator(config, pool) == 0

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tasks = load_environment(env_config).tasks("train")
    for step in (1, 2):
        for row in rows_of(config, step):
            check_token_columns(row)
            ids = row["token_ids"]
            runs = spans(row["loss_mask"])
            # prompt, turn 1, the environment's reply, turn 2
            assert [sampled for _, _, sampled in runs] == [False, True, False, True]
            (_, first, _), _, (reply_start, reply_end, _), _ = runs
            first_prompt = tokenizer.apply_chat_template(
                tasks[row["example_id"]].prompt, add_generation_prompt=True, tokenize=False
            )
            assert tokenizer.decode(ids[:first]) == first_prompt
            reply = tokenizer.decode(ids[reply_start:reply_end])
            assert "<|im_start|>user\nAdd these names" in reply
            assert reply.endswith("<|im_end|>\n<|im_start|>assistant\n")
            assert set(dict(row["metrics"])) >= {"turn_1_similarity", "turn_2_similarity"}
    metrics = read_metrics(run_store(config), "orchestrator")
    assert all(line["count/splits"] == 0 for line in metrics)


def test_a_classic_env_from_a_test_module_runs_and_its_failures_are_skipped(
    pool: InferencePool, make_config: Callable[..., PrimeflowConfig]
) -> None:
    flaky = EnvConfig(id="tests.unit.envs.flaky_env", args={"num_examples": 6, "fail_on": [1, 3]})
    config = make_config(orchestrator={"envs": [flaky], "max_async_level": 1})
    assert run_orchestrator(config, pool) == 0

    rows = rows_of(config, 1) + rows_of(config, 2)
    assert rows and {row["example_id"] for row in rows} <= {0, 2, 4, 5}
    metrics = read_metrics(run_store(config), "orchestrator")
    assert sum(line["count/skipped/env_error"] for line in metrics) >= 4


def _publish_after_rollouts(config: PrimeflowConfig, model: Path, step: int) -> None:
    """Stand in for the trainer: once `rollouts/step` is committed, publish `policies/step`."""
    wait_for_step(run_store(config), RunLayout.ROLLOUTS, step, timeout_s=120)
    _publish(config, model, step)


def _publish(config: PrimeflowConfig, model: Path, step: int) -> None:
    """Commit `model` as `policies/step`."""
    store = run_store(config)
    files = {
        name: (model / name).read_bytes()
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
    }
    write_checkpoint(
        store,
        step,
        weights=load_file(model / "model.safetensors"),
        config=json.loads((model / "config.json").read_text()),
        files=files,
        parent=RunLayout.POLICIES,
    )


def test_synchronous_bound_waits_for_and_loads_the_next_policy_version(
    pool: InferencePool, make_config: Callable[..., PrimeflowConfig], tiny_model: Path
) -> None:
    config = make_config(orchestrator={"max_async_level": 0})
    trainer = threading.Thread(target=_publish_after_rollouts, args=(config, tiny_model, 1))
    trainer.start()
    assert run_orchestrator(config, pool) == 0
    trainer.join()

    assert {row["policy_version"] for row in rows_of(config, 1)} == {0}
    assert {row["policy_version"] for row in rows_of(config, 2)} == {1}
    assert pool.policy_version == 1
    # On-policy, only what a batch still lacks is sampled (max_concurrent 16 is two batches):
    # nothing lands after its batch closed to be thrown away as stale.
    lines = read_metrics(run_store(config), "orchestrator")
    for line in lines:
        assert line["count/stale/async_bound"] == 0
        assert line["tokens/reverse-text/stale"] == 0
    # The reload of version 1 ended while batch 2 was built, and its time is broken down: the
    # fetch, then the server's pause and the four parts of it.
    swap = lines[1]
    inside = ("pause_call", "load", "reset", "resume_call")
    phases = [swap[f"time/reload_{phase}_s"] for phase in ("fetch", "paused", *inside)]
    assert all(seconds > 0 for seconds in phases), swap
    parts = sum(swap[f"time/reload_{phase}_s"] for phase in inside)
    assert parts == pytest.approx(swap["time/reload_paused_s"], abs=1e-3), swap
    assert swap["time/reload_fetch_s"] + swap["time/reload_paused_s"] <= swap["time/reload_s"]


def test_async_sampling_starts_no_more_than_the_bound_lets_batches_take(
    pool: InferencePool, make_config: Callable[..., PrimeflowConfig], tiny_model: Path
) -> None:
    """With four batches' worth in flight allowed, rollouts started on version 0 once filled
    batches 1-4, two versions beyond `max_async_level = 1`; now only batches 1 and 2."""
    config = make_config(max_steps=4, orchestrator={"max_async_level": 1, "max_concurrent": 32})

    def trainer() -> None:
        for step in range(1, 4):
            _publish_after_rollouts(config, tiny_model, step)

    publisher = threading.Thread(target=trainer)
    publisher.start()
    assert run_orchestrator(config, pool) == 0
    publisher.join()

    for step in range(1, 5):
        versions = {row["policy_version"] for row in rows_of(config, step)}
        assert min(versions) >= min_policy_version(step, 1), (step, versions)


class HeldReloads:
    """The shared pool, its reloads held until `release` is set (a swap that takes long)."""

    def __init__(self, pool: InferencePool) -> None:
        self.pool = pool
        self.started = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)

    def reload(self, checkpoint: str, version: int | None = None) -> int:
        self.started.set()
        self.release.wait()
        return self.pool.reload(checkpoint, version)


def test_sampling_goes_on_while_the_pool_loads_a_new_version(
    pool: InferencePool, make_config: Callable[..., PrimeflowConfig], tiny_model: Path
) -> None:
    config = make_config(max_steps=2, orchestrator={"max_async_level": 2})
    _publish(config, tiny_model, 1)  # committed before sampling starts
    held = HeldReloads(pool)
    sampled_while_held = threading.Event()

    def release_after_step_two() -> None:
        try:
            wait_for_step(run_store(config), RunLayout.ROLLOUTS, 2, timeout_s=90)
            sampled_while_held.set()
        finally:
            held.release.set()

    releaser = threading.Thread(target=release_after_step_two)
    releaser.start()
    assert run_orchestrator(config, held) == 0  # type: ignore[arg-type]
    releaser.join()

    assert held.started.is_set() and sampled_while_held.is_set()
    assert {row["policy_version"] for row in rows_of(config, 1) + rows_of(config, 2)} == {0}
    assert pool.policy_version == 1  # the run ended once the held reload had finished


def test_a_restarted_run_continues_after_its_last_committed_step(
    pool: InferencePool, make_config: Callable[..., PrimeflowConfig]
) -> None:
    env_config = EnvConfig(id="reverse-text", args={"num_train_examples": 64})
    first = make_config(max_steps=1, orchestrator={"envs": [env_config], "max_async_level": 3})
    assert run_orchestrator(first, pool) == 0
    again = first.model_copy(update={"max_steps": 2})
    again.orchestrator.max_steps = 2
    assert run_orchestrator(again, pool) == 0

    step_one, step_two = rows_of(first, 1), rows_of(first, 2)
    assert {row["step"] for row in step_two} == {2}
    # The task order went on where it stopped: step 2 drew new examples, not step 1's again.
    assert not {row["example_id"] for row in step_one} & {row["example_id"] for row in step_two}
    assert [line["step"] for line in read_metrics(run_store(first), "orchestrator")] == [1, 2]


class CountingReloads(HeldReloads):
    """The shared pool; each reload records whether a held-out evaluation was running then."""

    def __init__(self, pool: InferencePool, store_root: Any) -> None:
        super().__init__(pool)
        self.release.set()
        self.store = store_root
        self.evaluations_seen: list[int] = []

    def reload(self, checkpoint: str, version: int | None = None) -> int:
        steps = [line["step"] for line in read_metrics(self.store, ONLINE_EVAL_STAGE)]
        self.evaluations_seen.append(len(steps))
        return super().reload(checkpoint, version)


def test_online_evaluations_take_every_interval_s_policy_on_held_out_tasks(
    pool: InferencePool, make_config: Callable[..., PrimeflowConfig], tiny_model: Path
) -> None:
    """eval.interval = 1: versions 0, 1 and 2 are each evaluated (greedy and sampled) on the
    held-out split, every answer stamped with the version the line names, and the pool loads
    version n + 1 only after version n's evaluation is written."""
    config = make_config(
        max_steps=3,
        orchestrator={"max_async_level": 0},
        eval={
            "num_examples": 50,
            "interval": 1,
            "interval_examples": 4,
            "rollouts_per_example": 2,
            "sampling": {"max_tokens": 16},
        },
    )
    store = run_store(config)
    publishers = [
        threading.Thread(target=_publish_after_rollouts, args=(config, tiny_model, step))
        for step in (1, 2)
    ]
    for thread in publishers:
        thread.start()
    counting = CountingReloads(pool, store)
    assert run_orchestrator(config, counting) == 0  # type: ignore[arg-type]
    for thread in publishers:
        thread.join()

    lines = read_metrics(store, ONLINE_EVAL_STAGE)
    assert [line["step"] for line in lines] == [0, 1, 2]
    for line in lines:
        assert line["eval/reverse-text/samples"] == 8 and line["eval/reverse-text/examples"] == 4
        assert line["eval/reverse-text/greedy/samples"] == 4
        assert 0.0 <= line["eval/greedy/avg@1"] <= 1.0 and 0.0 <= line["eval/avg@2"] <= 1.0
    # Reload to version 1 came after version 0's line, reload to 2 after version 1's.
    assert counting.evaluations_seen == [1, 2]
    for line in read_metrics(store, "orchestrator"):
        assert 0.0 <= line["advantage/zero_group_fraction"] <= 1.0
        assert 0.0 <= line["advantage/nonzero_token_fraction"] <= 1.0


@pytest.mark.timeout(180)
def test_an_environment_whose_every_prompt_is_too_long_fails_the_run_instead_of_spinning(
    pool: InferencePool, make_config: Callable[..., PrimeflowConfig], caplog: Any
) -> None:
    """The calc tool env's prompts (the tool schema rendered in the system turn) outgrow a short
    context: every draw is skipped. The run used to draw again forever, 280,000 warnings in 10
    minutes; it now fails after one window of rollouts, in one line (issue 31)."""
    calc = EnvConfig(id="tests.unit.envs.calc_env")
    config = make_config(seq_len=300, orchestrator={"envs": [calc], "max_async_level": 1})
    with caplog.at_level("WARNING"), pytest.raises(EnvironmentSkippedError) as caught:
        run_orchestrator(config, pool)
    message = str(caught.value)
    assert message.startswith("environment 'tests.unit.envs.calc_env': ")
    assert "rollouts were skipped (prompt_too_long: example" in message
    assert "raise seq_len" in message and "\n" not in message
    skip_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipped")]
    assert 1 <= len(skip_lines) <= 3, skip_lines  # counted lines, not one per rollout
    assert committed_steps(run_store(config), RunLayout.ROLLOUTS) == []


@pytest.mark.timeout(180)
def test_a_filter_that_drops_every_group_fails_the_run_instead_of_spinning(
    pool: InferencePool, make_config: Callable[..., PrimeflowConfig]
) -> None:
    """The difficulty filter on a policy whose every sample scores alike drops every group, so
    the first batch never fills: on the debug config the run drew 7,888 rollouts in 9.5 minutes
    without a line or a step. It now fails once 64 groups in a row were dropped, in one line."""
    config = make_config(
        orchestrator={
            "envs": [EnvConfig(id="tests.unit.envs.collapsing_env")],  # 0 after 4 rollouts
            "filters": [{"type": "difficulty"}],
            "sampling": {"temperature": 1.0, "max_tokens": 4},
        },
    )
    with pytest.raises(FilteredOutError) as caught:
        run_orchestrator(config, pool)
    message = str(caught.value)
    assert message.startswith("orchestrator.filters (difficulty) dropped the last 64 groups")
    assert "(tests.unit.envs.collapsing_env: 64; their mean rewards all 0.000)" in message
    assert "\n" not in message
    assert committed_steps(run_store(config), RunLayout.ROLLOUTS) == []


@pytest.mark.timeout(180)
def test_a_reward_that_collapses_fails_the_run_after_the_steps_without_signal(
    pool: InferencePool, make_config: Callable[..., PrimeflowConfig]
) -> None:
    """On the GPU model at too high a rate tool-math's calls broke within 16 steps and the run
    sampled 84 more steps whose every group scored 0, each update skipped. Such a run now stops
    after `max_steps_without_signal` of them, every step before the stop committed."""
    config = make_config(
        max_steps=8,
        orchestrator={
            "envs": [EnvConfig(id="tests.unit.envs.collapsing_env")],
            "max_async_level": 8,  # no trainer here: every step samples version 0
            "max_steps_without_signal": 3,
            "max_concurrent": 8,  # one step ahead, short replies: the reward ignores them
            "sampling": {"temperature": 1.0, "max_tokens": 4},
        },
    )
    with pytest.raises(RewardCollapsedError) as caught:
        run_orchestrator(config, pool)
    lines = read_metrics(run_store(config), "orchestrator")
    last = lines[-1]["step"]
    assert str(caught.value).startswith(f"no learning signal for 3 steps ({last - 2}-{last}): ")
    assert last < config.orchestrator.max_steps
    assert committed_steps(run_store(config), RunLayout.ROLLOUTS) == list(range(1, last + 1))
    assert [line["advantage/zero_group_fraction"] for line in lines[-3:]] == [1.0, 1.0, 1.0]
    assert max(line["reward/mean"] for line in lines) > 0.0 == lines[-1]["reward/mean"]
