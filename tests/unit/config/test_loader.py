"""Config composition, precedence, unions, shared fields and the one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import ConfigError, PrimeflowConfig, load_config, with_overrides
from engine.config.trainer import CosineSchedulerConfig, MaskedRatioLossConfig


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults_fill_shared_fields_into_every_section() -> None:
    config = load_config([])
    assert config.trainer.model == config.inference.model == config.orchestrator.model
    assert config.trainer.model == config.model.name
    assert config.trainer.seq_len == config.orchestrator.seq_len == config.seq_len
    assert config.inference.max_model_len == config.seq_len
    assert config.trainer.max_steps == config.orchestrator.max_steps == config.max_steps


def test_a_stated_shared_field_fills_sections_that_hold_only_their_default() -> None:
    config = load_config(["--seq-len", "512", "--max-steps", "7", "--model.name", "m"])
    assert (config.trainer.seq_len, config.orchestrator.seq_len) == (512, 512)
    assert config.inference.max_model_len == 512
    assert (config.trainer.max_steps, config.orchestrator.max_steps) == (7, 7)
    assert config.trainer.model == config.inference.model == config.orchestrator.model == "m"


def test_the_schema_the_ui_draws_requires_no_field() -> None:
    """Sections' copies of shared fields have defaults, so the Prefect form asks for none."""
    schema = PrimeflowConfig.model_json_schema()
    sections = ("TrainerConfig", "InferenceConfig", "OrchestratorConfig")
    required = {name: schema["$defs"][name].get("required") for name in sections}
    assert not schema.get("required") and not any(required.values()), required


def test_files_compose_left_to_right_and_flags_win(tmp_path: Path) -> None:
    a = write(tmp_path, "a.toml", "[trainer.optim]\nlr = 1e-4\nweight_decay = 0.1\n")
    b = write(tmp_path, "b.toml", "[trainer.optim]\nlr = 2e-4\n")
    assert load_config(["@", a]).trainer.optim.lr == 1e-4
    both = load_config(["@", a, "@", b])
    assert both.trainer.optim.lr == 2e-4
    assert both.trainer.optim.weight_decay == 0.1  # a.toml's other keys survive b.toml
    assert load_config(["@", b, "@", a]).trainer.optim.lr == 1e-4
    flagged = load_config(["@", a, "@", b, "--trainer.optim.lr", "1e-5"])
    assert flagged.trainer.optim.lr == 1e-5
    assert flagged.trainer.optim.weight_decay == 0.1


def test_discriminated_unions_select_by_type(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "u.toml",
        '[trainer.scheduler]\ntype = "cosine"\nwarmup_steps = 5\nmin_lr_ratio = 0.1\n',
    )
    config = load_config(["@", path, "--trainer.loss.type", "masked_ratio"])
    assert isinstance(config.trainer.scheduler, CosineSchedulerConfig)
    assert config.trainer.scheduler.min_lr_ratio == 0.1
    assert isinstance(config.trainer.loss, MaskedRatioLossConfig)
    custom = load_config(
        [
            "--trainer.loss.type",
            "custom",
            "--trainer.loss.import-path",
            "my_pkg.losses:clipped",
            "--trainer.loss.kwargs",
            '{"clip": 0.2, "name": "x"}',
        ]
    )
    assert custom.trainer.loss.type == "custom"
    assert custom.trainer.loss.kwargs == {"clip": 0.2, "name": "x"}


def test_bool_flags_lists_and_json_dicts() -> None:
    config = load_config(
        [
            "--trainer.compile",
            "--no-sft.enabled",
            "--inference.extra-args",
            '["--enforce-eager", "--max-num-seqs=8"]',
            "--orchestrator.sampling.stop",
            "</a>",
            "</b>",
        ]
    )
    assert config.trainer.compile is True
    assert config.sft.enabled is False
    assert config.orchestrator.sampling.stop == ["</a>", "</b>"]
    assert config.inference.extra_args == ["--enforce-eager", "--max-num-seqs=8"]
    assert load_config(["--no-trainer.compile"]).trainer.compile is False


def test_a_lora_rank_flag_is_the_number_a_toml_file_gives() -> None:
    """The command line passes text; the servable ranks are a Literal of ints (issue 34)."""
    flags = ["--trainer.lora.rank", "16", "--inference.lora.max-rank", "16"]
    assert load_config(flags).inference.lora.max_rank == 16
    with pytest.raises(ConfigError, match=r"inference\.lora\.max_rank: Input should be 1, 8"):
        load_config(["--trainer.lora.rank", "8", "--inference.lora.max-rank", "17"])
    with pytest.raises(ConfigError, match=r"inference\.lora\.max_rank"):
        load_config(["--trainer.lora.rank", "8", "--inference.lora.max-rank", "sixteen"])


def test_null_unsets_a_field_that_may_be_none_and_is_text_elsewhere(tmp_path: Path) -> None:
    config = load_config(["--sft.data.path", "null", "--run.name", "null"])
    assert config.sft.data.path is None
    assert config.run.name == "null"  # a run name cannot be None: "null" is its text
    file = tmp_path / "unset.toml"
    file.write_text('[sft.data]\npath = "null"\n')
    assert load_config(["@", str(file)]).sft.data.path is None


def test_the_dry_run_json_takes_overrides_of_shared_fields() -> None:
    printed = load_config(["--seq-len", "512", "--max-steps", "9"])
    config = PrimeflowConfig.model_validate(printed.model_dump(mode="json"))  # every field set
    changed = with_overrides(config, {"seq_len": 256, "max_steps": 7})
    seq_lens = (changed.trainer.seq_len, changed.orchestrator.seq_len)
    assert seq_lens == (256, 256) and changed.inference.max_model_len == 256
    assert (changed.trainer.max_steps, changed.orchestrator.max_steps) == (7, 7)
    with pytest.raises(ConfigError, match=r"trainer\.seq_len = 128 conflicts"):
        with_overrides(config, {"seq_len": 256, "trainer.seq_len": 128})


def test_env_list_from_toml(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "envs.toml",
        '[[orchestrator.envs]]\nid = "reverse-text"\nratio = 3\n'
        '[[orchestrator.envs]]\nid = "arithmetic"\nargs = {max_value = 20}\n',
    )
    envs = load_config(["@", path]).orchestrator.envs
    assert [e.id for e in envs] == ["reverse-text", "arithmetic"]
    assert envs[1].args == {"max_value": 20}


def test_shared_field_conflict_is_an_error_and_agreement_is_fine(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"trainer\.seq_len = 512 conflicts with the shared seq_len"
    ):
        load_config(["--seq-len", "1024", "--trainer.seq-len", "512"])
    agreed = load_config(["--seq-len", "1024", "--trainer.seq-len", "1024"])
    assert agreed.orchestrator.seq_len == 1024
    # A section may differ from a shared field that was left at its default.
    alone = load_config(["--trainer.seq-len", "512"])
    assert alone.trainer.seq_len == 512
    assert alone.orchestrator.seq_len == alone.seq_len


def test_unknown_key_in_a_file_names_the_file_and_the_key(tmp_path: Path) -> None:
    good = write(tmp_path, "good.toml", "[trainer.optim]\nlr = 1e-4\n")
    bad = write(tmp_path, "bad.toml", "[trainer.optim]\nlearning_rate = 1e-4\n")
    with pytest.raises(ConfigError) as err:
        load_config(["@", good, "@", bad])
    message = str(err.value)
    assert message.startswith(f"{bad}: trainer.optim.learning_rate: unknown key")
    assert "\n" not in message


def test_bad_values_name_their_source(tmp_path: Path) -> None:
    path = write(tmp_path, "neg.toml", "[trainer.optim]\nlr = -1.0\n")
    with pytest.raises(ConfigError, match=rf"^{path}: trainer\.optim\.lr: Input should be greater"):
        load_config(["@", path])
    with pytest.raises(ConfigError, match=r"^command line: orchestrator\.batch_size: .*integer"):
        load_config(["--orchestrator.batch-size", "many"])
    with pytest.raises(
        ConfigError, match=r"^command line: trainer\.loss\.ratio_cap: .*greater than 1"
    ):
        load_config(["--trainer.loss.ratio-cap", "0.5"])
    with pytest.raises(ConfigError, match=r"trainer\.scheduler.*'warmup'"):
        load_config(["--trainer.scheduler.type", "warmup"])


def test_file_problems_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing\.toml: config file not found"):
        load_config(["@", str(tmp_path / "missing.toml")])
    broken = write(tmp_path, "broken.toml", "[trainer\nlr = 1\n")
    with pytest.raises(ConfigError, match=r"broken\.toml: invalid TOML"):
        load_config(["@", broken])
    with pytest.raises(ConfigError, match="must be followed by a config file"):
        load_config(["@"])


def test_run_names_are_validated() -> None:
    for bad in ["../escape", "a/b", "", " spaced"]:
        with pytest.raises(ConfigError, match=r"run\.name"):
            load_config(["--run.name", bad])
    assert load_config(["--run.name", "reverse-text.v2_1"]).run.name == "reverse-text.v2_1"


def test_resolved_config_round_trips_and_hides_secrets() -> None:
    config = load_config(["--inference.api-key", "sk-very-secret", "--seq-len", "512"])
    assert config.inference.api_key is not None
    assert config.inference.api_key.get_secret_value() == "sk-very-secret"
    dumped = config.model_dump(mode="json")
    assert "sk-very-secret" not in str(dumped)
    again = PrimeflowConfig.model_validate(
        dumped | {"inference": dumped["inference"] | {"api_key": None}}
    )
    assert again.trainer.seq_len == 512
    assert again.model_dump(mode="json")["trainer"] == dumped["trainer"]


def test_shipped_configs_resolve() -> None:
    root = Path(__file__).resolve().parents[3] / "configs"
    files = sorted(root.rglob("*.toml"))
    assert files, "no shipped configs found"
    for file in files:
        load_config(["@", str(file)])


def test_resume_checkpoints_have_their_own_cadence() -> None:
    """Inference loads policy versions (every step), so the checkpoint interval is free."""
    config = load_config(["--trainer.checkpoint.interval", "50"])
    assert config.trainer.checkpoint.interval == 50 and config.orchestrator.max_async_level == 1
    assert load_config([]).trainer.checkpoint.interval == 10
