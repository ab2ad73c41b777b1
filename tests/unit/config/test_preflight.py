"""What a config needs of this machine is checked before any pool starts, one line per problem."""

from __future__ import annotations

from pathlib import Path

from engine.config import PrimeflowConfig, with_overrides
from engine.preflight import preflight


def test_the_default_config_passes() -> None:
    assert preflight(PrimeflowConfig()) == []


def test_each_missing_piece_is_named_by_its_key(tmp_path: Path) -> None:
    (tmp_path / "empty-model").mkdir()
    config = with_overrides(
        PrimeflowConfig(),
        {
            "model.name": str(tmp_path / "empty-model"),
            "eval.envs": [{"id": "reverse-text"}, {"id": "not-installed-env"}],
            "sft.data.path": str(tmp_path / "conversations.jsonl"),
        },
    )
    assert preflight(config) == [
        f"model.name: model path {tmp_path / 'empty-model'} has no config.json",
        "eval.envs[1].id: environment 'not-installed-env' not found: no module "
        "'not_installed_env' is installed. Use a built-in (reverse-text, alphabet-sort, "
        "arithmetic, tool-math, corpus-search, wordle) or install the environment package into "
        "this venv",
        f"sft.data.path = {tmp_path / 'conversations.jsonl'}: no such file",
    ]
    # SFT's data matters only to commands that run SFT; a hub dataset name is not a path.
    assert len(preflight(config, ("rl", "eval"))) == 2
    hub = with_overrides(PrimeflowConfig(), {"sft.data.path": "org/paragraphs-v1"})
    assert preflight(hub) == []


def test_sft_data_from_a_package_must_name_its_function() -> None:
    config = with_overrides(PrimeflowConfig(), {"sft.data.env": "my-package-env"})
    assert preflight(config) == [
        "sft.data.env = 'my-package-env' is not a built-in environment; name a source as "
        "'package.module:function'"
    ]


def test_an_environment_that_raises_while_loading_is_named_with_the_exception_type() -> None:
    config = with_overrides(
        PrimeflowConfig(),
        {"eval.envs": [{"id": "tests.unit.reliability.bad_reward_env", "args": {"nope": 1}}]},
    )
    assert preflight(config) == [
        "eval.envs[0]: environment 'tests.unit.reliability.bad_reward_env' failed to load: "
        "TypeError: load_environment() got an unexpected keyword argument 'nope'"
    ]


def test_an_environment_whose_prompts_cannot_fit_seq_len_is_refused_with_the_length_it_needs() -> (
    None
):
    """The tool schema the template renders makes every calc prompt longer than a short context:
    drawn and skipped forever at run time once, refused here in one line now (issue 31)."""
    calc = [{"id": "tests.unit.envs.calc_env"}]
    short = with_overrides(
        PrimeflowConfig(),
        {"seq_len": 448, "orchestrator.envs": calc, "orchestrator.sampling.max_tokens": 80},
    )
    (problem,) = preflight(short, ("rl",))
    assert problem.startswith(
        "orchestrator.envs[0]: environment 'tests.unit.envs.calc_env': its train prompts take up "
        "to "
    )
    needed = int(problem.rsplit("at least ", 1)[1])
    tokens = int(problem.split("take up to ")[1].split()[0])
    assert needed == tokens + 80 > 448 and "orchestrator.sampling.max_tokens = 80" in problem
    assert preflight(with_overrides(short, {"seq_len": needed}), ("rl",)) == []
