"""Environments by id: built-ins, classic verifiers modules, v1 tasksets, and what is refused."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from engine.config.orchestrator import EnvConfig, SamplingConfig
from engine.envs import BUILTIN_ENVS, SamplerFailedError, assemble, load_environment
from tests.unit.envs.conftest import last_user_text

SAMPLING = SamplingConfig(max_tokens=32)
SMALL = {"num_train_examples": 8, "num_eval_examples": 4}


@pytest.mark.parametrize("env_id", sorted(BUILTIN_ENVS))
def test_builtins_load_offline_with_train_and_eval_splits(env_id: str) -> None:
    env = load_environment(EnvConfig(id=env_id, args=SMALL))
    assert env.name == env_id
    train, held_out = env.tasks("train"), env.tasks("eval")
    assert (len(train), len(held_out)) == (8, 4)
    assert [t.example_id for t in train] == list(range(8))
    assert {str(t.prompt) for t in train}.isdisjoint({str(t.prompt) for t in held_out})
    assert train[0].prompt[-1]["role"] == "user"


def test_an_unknown_id_names_the_missing_module() -> None:
    with pytest.raises(ValueError, match=r"no module 'no_such_env_pkg' is installed"):
        load_environment(EnvConfig(id="no-such-env-pkg"))


def test_a_module_that_is_no_environment_is_refused() -> None:
    with pytest.raises(ValueError, match="has no `load_environment`"):
        load_environment(EnvConfig(id="tests.unit.envs.conftest"))


def test_classic_env_by_module_id_with_args_runs_and_isolates_failing_tasks(
    policy: Any, generator: Any
) -> None:
    config = EnvConfig(
        id="tests.unit.envs.flaky_env", name="flaky", args={"num_examples": 3, "fail_on": [1]}
    )
    env = load_environment(config)
    tasks = env.tasks("train")
    gen = generator(policy(last_user_text))

    good = asyncio.run(env.run_group(tasks[0], 3, gen, SAMPLING))
    assert [r.reward for r in good] == [1.0, 1.0, 1.0]
    assert all(r.error is None and r.env == "flaky" and len(r.turns) == 1 for r in good)
    assert good[0].metrics["echoed"] == 1.0

    bad = asyncio.run(env.run_group(tasks[1], 2, gen, SAMPLING))
    assert all("environment bug on example 1" in (r.error or "") for r in bad)
    assert all(math.isnan(r.reward) and not r.turns for r in bad)


def test_a_failing_inference_pool_is_not_mistaken_for_an_env_error(generator: Any) -> None:
    class Down:
        async def generate(self, *args: Any, **kwargs: Any) -> list[Any]:
            raise ConnectionError("refused")

    env = load_environment(EnvConfig(id="tests.unit.envs.flaky_env"))
    with pytest.raises(SamplerFailedError, match="refused"):
        asyncio.run(env.run_group(env.tasks("train")[0], 2, generator(Down()), SAMPLING))


def test_v1_taskset_by_id_with_config_args_is_played_and_scored_by_the_task(
    hf_tokenizer: Any, policy: Any, generator: Any
) -> None:
    env = load_environment(
        EnvConfig(id="tests.unit.envs.echo_taskset", args={"words": ["sun", "moon"]})
    )
    tasks = env.tasks("train")
    assert [t.prompt for t in tasks] == [
        [{"role": "system", "content": "Echo."}, {"role": "user", "content": "Repeat: sun"}],
        [{"role": "system", "content": "Echo."}, {"role": "user", "content": "Repeat: moon"}],
    ]
    gen = generator(policy(lambda p: last_user_text(p).removeprefix("Repeat: ")))
    rollouts = asyncio.run(env.run_group(tasks[1], 2, gen, SAMPLING))
    assert [(r.reward, r.metrics) for r in rollouts] == [
        (1.0, {"reply_length": 4.0, "repeated": 1.0})
    ] * 2
    (sequence,) = assemble(rollouts[0].turns)
    expected = hf_tokenizer.apply_chat_template(
        tasks[1].prompt, add_generation_prompt=True, tokenize=False
    )
    assert hf_tokenizer.decode(sequence.token_ids) == expected + "moon<|im_end|>"


def test_v1_tasksets_needing_a_container_are_refused() -> None:
    with pytest.raises(ValueError, match="needs a container runtime"):
        load_environment(EnvConfig(id="tests.unit.envs.boxed_taskset"))


def test_a_prompt_longer_than_the_context_is_reported_not_raised(
    policy: Any, generator: Any
) -> None:
    env = load_environment(EnvConfig(id="reverse-text", args=SMALL))
    gen = generator(policy(lambda p: "x"), max_seq_len=20)
    (rollout,) = asyncio.run(env.run_group(env.tasks("train")[0], 1, gen, SAMPLING))
    assert rollout.context_exhausted and not rollout.turns and rollout.error is None
