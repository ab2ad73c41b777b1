"""Bad input is refused in one line that names the file, key, row or URI — or counted and skipped.

A multi-hour run that dies on a typo an hour in, or with a traceback that never names the bad
row, costs the user the hour. Each case here feeds one kind of bad input to the real code that
owns the check and asserts the exact outcome: the error class and a single line naming what is
wrong. The table of cases and outcomes is kept in `docs/reliability.md`; change both together.
"""

# The case tables keep one case per line, so that each reads as a row of the docs table.
# ruff: noqa: E501

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import torch
from transformers import AutoTokenizer

from engine.config.orchestrator import EnvConfig, SamplingConfig
from engine.config.plugin import CustomPluginConfig
from engine.config.sft import SftDataConfig
from engine.envs import Rollout, Turn, load_environment
from engine.local_checkpoints import CheckpointError, local_checkpoint
from engine.models.char_tokenizer import write_tokenizer
from engine.models.resolve import ModelPathError, resolve_model
from engine.orchestrator.advantages import group_relative
from engine.orchestrator.samples import build_group
from engine.trainer.rollouts import RolloutDataError, samples_from_rollouts
from engine.trainer.sft_data import SftDataError, load_sft_dataset
from flows.cli import main
from storage.checkpoints import fetch_checkpoint, write_checkpoint
from storage.commit import MARKER, commit_step, verify_step
from storage.errors import CorruptObjectError, InvalidRolloutError, NotCommittedError
from storage.layout import RunLayout
from storage.shard_schema import rows_to_table
from storage.shards import read_rollouts, shard_name, write_rollouts
from storage.store import ObjectStore
from tests.unit.envs.conftest import last_user_text
from tests.unit.storage.samples import make_row, rows

# --------------------------------------------------------------------------- config (CLI)

#: (case id, TOML file content or None, extra CLI args, regex for the line after "primeflow rl: ")
#: `{file}` in the regex stands for the config file's path.
CONFIG_CASES: list[tuple[str, str | None, list[str], str]] = [
    ("toml-unclosed-table", "[trainer\nx = 1", [], r"{file}: invalid TOML: Expected '\]' .*line 1"),
    ("toml-missing-value", "seq_len = ", [], r"{file}: invalid TOML: Invalid value"),
    ("toml-duplicate-key", "seq_len = 32\nseq_len = 64", [], r"{file}: invalid TOML: Cannot overwrite a value"),
    ("toml-not-utf8", None, [], r"{file}: not UTF-8 text"),
    ("unknown-top-key", "sequence_len = 32", [], r"{file}: sequence_len: unknown key \(got 32\)"),
    ("unknown-nested-key", "[trainer.optim]\nlrr = 1e-5", [], r"{file}: trainer\.optim\.lrr: unknown key"),
    ("unknown-section", "[trainr]\nlr = 1", [], r"{file}: trainr: unknown key"),
    ("unknown-key-cli", None, ["--trainer.optim.lrr", "1"], r"command line: trainer\.optim\.lrr: unknown key \(got '1'\)"),
    ("wrong-type-int", 'seq_len = "long"', [], r"{file}: seq_len: Input should be a valid integer.*\(got 'long'\)"),
    ("wrong-type-float", '[trainer.optim]\nlr = "fast"', [], r"{file}: trainer\.optim\.lr: Input should be a valid number.*\(got 'fast'\)"),
    ("wrong-type-bool", '[trainer]\ntruncate = "maybe"', [], r"{file}: trainer\.truncate: Input should be a valid boolean.*\(got 'maybe'\)"),
    ("wrong-type-list", "[inference]\ngpu_ids = 3", [], r"{file}: inference\.gpu_ids: Input should be a valid list \(got 3\)"),
    ("wrong-type-cli", None, ["--seq-len", "abc"], r"command line: seq_len: Input should be a valid integer.*\(got 'abc'\)"),
    ("range-seq-len", "seq_len = 4", [], r"{file}: seq_len: Input should be greater than or equal to 16 \(got 4\)"),
    ("range-max-steps", "max_steps = 0", [], r"{file}: max_steps: Input should be greater than or equal to 1 \(got 0\)"),
    ("range-seed", "[run]\nseed = -1", [], r"{file}: run\.seed: Input should be greater than or equal to 0 \(got -1\)"),
    ("range-port", "[inference]\nbase_port = 70000", [], r"{file}: inference\.base_port: Input should be less than or equal to 65535"),
    ("range-gpu-memory", "[inference]\ngpu_memory_utilization = 1.5", [], r"{file}: inference\.gpu_memory_utilization: Input should be less than or equal to 1"),
    ("range-storage-retries", "[storage]\nretries = 100", [], r"{file}: storage\.retries: Input should be less than or equal to 20"),
    ("shared-field-conflict", "seq_len = 64\n[trainer]\nseq_len = 128", [], r"{file}: trainer\.seq_len = 128 conflicts with the shared seq_len = 64; set only one of them"),
    ("run-name-dotdot", '[run]\nname = "a..b"', [], r"{file}: run\.name: run name 'a\.\.b' must not contain '\.\.'"),
    ("run-name-parent", '[run]\nname = "../escape"', [], r"{file}: run\.name: run name '\.\./escape' must not contain '/'"),
    ("run-name-slash", '[run]\nname = "a/b"', [], r"{file}: run\.name: run name 'a/b' must not contain '/'"),
    ("run-name-empty", '[run]\nname = ""', [], r"{file}: run\.name: run name must not be empty"),
    ("run-name-space", '[run]\nname = "my run"', [], r"{file}: run\.name: run name 'my run' must not contain whitespace"),
    ("storage-scheme", '[storage]\nuri = "ftp://host/runs"', [], r"{file}: storage\.uri: unsupported scheme 'ftp': use file://, memory://, s3:// or gs://"),
    ("plugin-import-path-shape", '[trainer.loss]\ntype = "custom"\nimport_path = "not a path"', [], r"{file}: trainer\.loss\.import_path: must look like 'package\.module:function'.*\(got 'not a path'\)"),
    ("inference-gpu-ids-count", "[inference]\nnum_servers = 2\ngpu_ids = [0]", [], r"{file}: inference: gpu_ids lists 1 devices; num_servers × tensor_parallel_size needs 2"),
    ("inference-cpu-cores-count", '[inference]\ncpu_cores = ["0-1", "2-3"]', [], r"{file}: inference: cpu_cores has 2 entries; give one per server \(1\)"),
    ("inference-dtype", '[inference]\ndtype = "int3"', [], r"{file}: inference\.dtype: Input should be 'auto', 'bfloat16', 'float16' or 'float32' \(got 'int3'\)"),
    ("rl-greedy-sampling", '[orchestrator.sampling]\ntemperature = 0.0', [], r"{file}: orchestrator: sampling\.temperature must be > 0 for RL \(got 0\.0\): the trainer weighs samples by their sampling probability"),
    ("off-policy-under-async-bound", "[orchestrator]\nmax_async_level = 2\nmax_off_policy_steps = 1", [], r"{file}: orchestrator: max_off_policy_steps \(1\) must be at least max_async_level \(2\): it would drop the rollouts the async bound starts"),
    ("lora-target-head", '[trainer.lora]\ntarget_modules = ["q_proj", "lm_head"]', [], r"{file}: trainer\.lora: target_modules: \['lm_head'\] cannot take a LoRA adapter"),
    ("lora-rank-over-serving", "[trainer.lora]\nrank = 32\n[inference.lora]\nmax_rank = 16", [], r"{file}: trainer\.lora\.rank = 32 exceeds inference\.lora\.max_rank = 16: the servers could not load the adapters"),
    ("pools-full-weights", '[pools]\nname = "shared"', [], r"{file}: pools\.name = 'shared' shares pools between LoRA runs: set trainer\.lora \(a full-weight run gets pools of its own: leave pools\.name unset\)"),
    ("pools-lease-shorter-than-heartbeat", '[pools]\nname = "shared"\nlease_s = 1.0\nheartbeat_s = 2.0\n[trainer.lora]\nrank = 8', [], r"{file}: pools\.heartbeat_s = 2 must be shorter than pools\.lease_s = 1, or a live tenant's lease would lapse"),
    ("pools-name", '[pools]\nname = "a/b"', [], r"{file}: pools\.name: .*must not contain '/'"),
    ("pools-full-weight-sft", '[pools]\nname = "shared"\n[trainer.lora]\nrank = 8\n[sft]\nfull_weights = true', [], r"{file}: sft\.full_weights = true gives this run a base model of its own, but a tenant of pools\.name = 'shared' trains its adapter on the pools' model: warm the base up before the pools start, or leave pools\.name unset"),
    ("inference-device", '[inference]\ndevice = "tpu"', [], r"{file}: inference\.device: Input should be 'auto', 'cpu' or 'cuda' \(got 'tpu'\)"),
    ("config-file-missing", None, ["@", "/nonexistent/x.toml"], r"/nonexistent/x\.toml: config file not found"),
    ("config-file-not-toml", None, ["@", "{json}"], r"{json}: config files must be TOML \(\.toml\)"),
    ("config-at-without-file", None, ["@"], r"'@' must be followed by a config file path"),
    ("preflight-model-folder", None, ["--model.name", "./no-such-model"], r"model\.name: model path \./no-such-model does not exist"),
    ("preflight-env-not-installed", '[[orchestrator.envs]]\nid = "no-such-env"', [], r"orchestrator\.envs\[0\]\.id: environment 'no-such-env' not found: no module 'no_such_env' is installed\."),
    ("preflight-env-load-raises", '[[orchestrator.envs]]\nid = "tests.unit.reliability.bad_reward_env"\nargs = {nope = 1}', [], r"orchestrator\.envs\[0\]: environment 'tests\.unit\.reliability\.bad_reward_env' failed to load: TypeError: load_environment\(\) got an unexpected keyword argument 'nope'"),
    ("preflight-prompts-too-long", 'seq_len = 448\n[[orchestrator.envs]]\nid = "tests.unit.envs.calc_env"\n[orchestrator.sampling]\nmax_tokens = 80', [], r"orchestrator\.envs\[0\]: environment 'tests\.unit\.envs\.calc_env': its train prompts take up to \d+ tokens \(example \d+, chat template, system prompt and tools included\), which leaves no room for orchestrator\.sampling\.max_tokens = 80 in seq_len = 448: set seq_len to at least \d+"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("content", "extra", "expected"),
    [pytest.param(c, e, x, id=i) for i, c, e, x in CONFIG_CASES],
)
def test_bad_config_exits_2_with_one_line_naming_the_key(
    content: str | None,
    extra: list[str],
    expected: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
) -> None:
    file = tmp_path / "bad.toml"
    json_file = tmp_path / "config.json"
    json_file.write_text("{}")
    args = ["rl", "--dry-run"]
    if content is not None:
        file.write_text(content)
        args += ["@", str(file)]
    elif request.node.callspec.id == "toml-not-utf8":
        file.write_bytes(b"seq_len = 32 # \xff\xfe\n")
        args += ["@", str(file)]
    args += [a.replace("{json}", str(json_file)) for a in extra]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    pattern = expected.replace("{file}", str(file)).replace("{json}", str(json_file))
    assert _fullmatch(rf"primeflow rl: {pattern}.*", err.rstrip("\n")), err


def _fullmatch(pattern: str, text: str) -> bool:
    return re.fullmatch(pattern, text) is not None


# ----------------------------------------------------------------- data, storage, plugins


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(folder, model_max_length=4096)
    return AutoTokenizer.from_pretrained(str(folder))


def _store(tmp_path: Path) -> ObjectStore:
    return ObjectStore(f"file://{tmp_path}/run", backoff_s=0.001)


def _sft(tmp_path: Path, tokenizer: Any, lines: list[Any], seq_len: int = 256) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(
        "".join(f"{line if isinstance(line, str) else json.dumps(line)}\n" for line in lines)
    )
    config = SftDataConfig(path=str(path), eval_fraction=0.0)
    load_sft_dataset(config, tokenizer, seq_len=seq_len, seed=0, allow_truncation=False)


def _write_shard(store: ObjectStore, table: pa.Table, step: int = 3) -> None:
    """A shard written past the writer's checks, as a foreign or buggy writer would."""
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    step_dir = RunLayout.rollouts_dir(step)
    store.write_bytes(f"{step_dir}/{shard_name(0)}", sink.getvalue().to_pybytes())
    commit_step(store, step_dir, [shard_name(0)], step=step, rows=table.num_rows)


def _rollout_rows(tmp_path: Path, **changes: Any) -> None:
    write_rollouts(_store(tmp_path), 3, [make_row(0), make_row(1, **changes)])


def _foreign_shard(tmp_path: Path, change: Callable[[pa.Table], pa.Table]) -> None:
    store = _store(tmp_path)
    _write_shard(store, change(rows_to_table(rows(4))))
    read_rollouts(store, 3)


def _committed_shard(tmp_path: Path) -> ObjectStore:
    store = _store(tmp_path)
    write_rollouts(store, 3, rows(4))
    return store


def _truncate(store: ObjectStore, path: str, keep: int | None = None) -> None:
    data = store.read_bytes(path)
    store.write_bytes(path, data[: len(data) // 2 if keep is None else keep])


def _flip(store: ObjectStore, path: str) -> None:
    data = bytearray(store.read_bytes(path))
    data[len(data) // 2] ^= 0xFF
    store.write_bytes(path, bytes(data))


def _trained(tmp_path: Path, changes: dict[str, Any], **kwargs: Any) -> None:
    table = rows_to_table([make_row(0), make_row(1, **changes)])
    options = {"step": 3, "vocab_size": 256, "seq_len": 64, "allow_truncation": False} | kwargs
    samples_from_rollouts(table, **options)


def _checkpoint(tmp_path: Path) -> ObjectStore:
    store = _store(tmp_path)
    weights = {"model.embed_tokens.weight": torch.zeros(4, 2)}
    write_checkpoint(store, 2, weights=weights, config={"model_type": "qwen3"})
    return store


def _ckpt_truncated(tmp_path: Path) -> None:
    store = _checkpoint(tmp_path)
    _truncate(store, f"{RunLayout.checkpoint_dir(2)}/model.safetensors")
    fetch_checkpoint(store, 2, tmp_path / "local")


def _ckpt_flipped(tmp_path: Path) -> None:
    store = _checkpoint(tmp_path)
    _flip(store, f"{RunLayout.checkpoint_dir(2)}/config.json")
    verify_step(store, RunLayout.checkpoint_dir(2))


def _ckpt_no_marker(tmp_path: Path) -> None:
    store = _checkpoint(tmp_path)
    store.delete(f"{RunLayout.checkpoint_dir(2)}/{MARKER}")
    fetch_checkpoint(store, 2, tmp_path / "local")


def _ckpt_bad_marker(tmp_path: Path) -> None:
    store = _checkpoint(tmp_path)
    store.write_bytes(f"{RunLayout.checkpoint_dir(2)}/{MARKER}", b'{"version": 1, "step": 2')
    fetch_checkpoint(store, 2, tmp_path / "local")


def _ckpt_missing_file(tmp_path: Path) -> None:
    store = _checkpoint(tmp_path)
    store.delete(f"{RunLayout.checkpoint_dir(2)}/model.safetensors")
    fetch_checkpoint(store, 2, tmp_path / "local")


def _shard_truncated(tmp_path: Path) -> None:
    store = _committed_shard(tmp_path)
    _truncate(store, f"{RunLayout.rollouts_dir(3)}/{shard_name(0)}")
    read_rollouts(store, 3)


def _shard_flipped(tmp_path: Path) -> None:
    store = _committed_shard(tmp_path)
    _flip(store, f"{RunLayout.rollouts_dir(3)}/{shard_name(0)}")
    read_rollouts(store, 3)


def _shard_no_marker(tmp_path: Path) -> None:
    store = _committed_shard(tmp_path)
    store.delete(f"{RunLayout.rollouts_dir(3)}/{MARKER}")
    read_rollouts(store, 3)


def _shard_not_arrow(tmp_path: Path) -> None:
    store = _store(tmp_path)
    step_dir = RunLayout.rollouts_dir(3)
    store.write_bytes(f"{step_dir}/{shard_name(0)}", b"PAR1 this is not arrow")
    commit_step(store, step_dir, [shard_name(0)], step=3)
    read_rollouts(store, 3)


def _model_folder_without_config(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    resolve_model(str(tmp_path / "model"))


def _local_checkpoint_missing(tmp_path: Path) -> None:
    local_checkpoint(str(tmp_path / "ckpt"), tmp_path / "cache")


#: (case id, the bad input applied to the real code, error class, regex of the whole message)
ERROR_CASES: list[tuple[str, Callable[[Path, Any], None], type[Exception], str]] = [
    ("model-path-missing", lambda t, _: resolve_model("/no/such/model"), ModelPathError, r"model path /no/such/model does not exist"),
    ("model-path-relative-missing", lambda t, _: resolve_model("./no/such/model"), ModelPathError, r"model path \./no/such/model does not exist"),
    ("model-folder-without-config", lambda t, _: _model_folder_without_config(t), ModelPathError, r"model path .*/model has no config\.json"),
    ("sft-file-missing", lambda t, tok: load_sft_dataset(SftDataConfig(path=str(t / "none.jsonl")), tok, seq_len=64, seed=0, allow_truncation=False), SftDataError, r"sft\.data\.path = .*/none\.jsonl: no such file"),
    ("sft-no-columns", lambda t, tok: _sft(t, tok, [{"question": "q", "answer": "a"}]), SftDataError, r".*data\.jsonl row 0: needs `messages` or `prompt` \+ `completion`; has \['question', 'answer'\]"),
    ("sft-missing-completion", lambda t, tok: _sft(t, tok, [{"prompt": "q"}]), SftDataError, r".*data\.jsonl row 0: needs `messages` or `prompt` \+ `completion`; has \['prompt'\]"),
    ("sft-empty-row", lambda t, tok: _sft(t, tok, [{"prompt": "q", "completion": "a"}, {}]), SftDataError, r".*data\.jsonl row 1: needs `messages` or `prompt` \+ `completion`; has \[\]"),
    ("sft-empty-messages", lambda t, tok: _sft(t, tok, [{"messages": []}]), SftDataError, r".*data\.jsonl row 0: no assistant message, so nothing to train on"),
    ("sft-no-assistant", lambda t, tok: _sft(t, tok, [{"messages": [{"role": "user", "content": "hi"}]}]), SftDataError, r".*data\.jsonl row 0: no assistant message, so nothing to train on"),
    ("sft-oversized-row", lambda t, tok: _sft(t, tok, [{"prompt": "p" * 300, "completion": "c"}], seq_len=64), SftDataError, r".*data\.jsonl row 0: \d+ tokens exceed seq_len=64; raise seq_len or set trainer\.truncate = true"),
    ("sft-not-json-line", lambda t, tok: _sft(t, tok, ['{"prompt": "q", "completion": "a"}', "{oops"]), SftDataError, r".*data\.jsonl:2: not JSON: .*"),
    ("sft-empty-file", lambda t, tok: _sft(t, tok, []), SftDataError, r".*data\.jsonl: no rows"),
    ("rows-missing-column", lambda t, _: write_rollouts(_store(t), 3, [make_row(0), {k: v for k, v in make_row(1).items() if k != "reward"}]), InvalidRolloutError, r"<rows>: row 1, column 'reward': is missing"),
    ("rows-extra-column", lambda t, _: write_rollouts(_store(t), 3, [make_row(0, score=1.0)]), InvalidRolloutError, r"<rows>: row 0, column 'score': is not declared in ROLLOUT_SCHEMA"),
    ("rows-wrong-type", lambda t, _: _rollout_rows(t, reward="high"), InvalidRolloutError, r"<rows>: row 1, column 'reward': cannot hold 'high'.*"),
    ("rows-ragged-logprobs", lambda t, _: _rollout_rows(t, logprobs=[0.0]), InvalidRolloutError, r"file://.*/rollouts/step_000003/shard-00000\.arrow: row 1, column 'logprobs': has 1 items but token_ids has \d+: per-token columns must have equal lengths"),
    ("rows-ragged-loss-mask", lambda t, _: _rollout_rows(t, loss_mask=[True]), InvalidRolloutError, r".*shard-00000\.arrow: row 1, column 'loss_mask': has 1 items but token_ids has \d+.*"),
    ("rows-nan-reward", lambda t, _: _rollout_rows(t, reward=math.nan), InvalidRolloutError, r".*shard-00000\.arrow: row 1, column 'reward': is nan, not a finite number"),
    ("rows-inf-advantage", lambda t, _: _rollout_rows(t, advantage=math.inf), InvalidRolloutError, r".*shard-00000\.arrow: row 1, column 'advantage': is inf, not a finite number"),
    ("rows-negative-token-id", lambda t, _: _rollout_rows(t, token_ids=[1, -5, 3, 4]), InvalidRolloutError, r".*shard-00000\.arrow: row 1, column 'token_ids': token id -5 is negative"),
    ("rows-wrong-step", lambda t, _: _rollout_rows(t, step=9), InvalidRolloutError, r".*shard-00000\.arrow: row 1, column 'step': is 9 but the shard belongs to step 3"),
    ("rows-null-env", lambda t, _: _rollout_rows(t, env=None), InvalidRolloutError, r".*shard-00000\.arrow: row 1, column 'env': is null"),
    ("shard-wrong-schema", lambda t, _: _foreign_shard(t, lambda tb: tb.drop_columns(["advantage"])), InvalidRolloutError, r"file://.*/shard-00000\.arrow: column 'advantage': is missing"),
    ("shard-wrong-column-type", lambda t, _: _foreign_shard(t, lambda tb: tb.set_column(tb.schema.get_field_index("reward"), "reward", pa.array(["x"] * tb.num_rows))), InvalidRolloutError, r".*/shard-00000\.arrow: column 'reward': has type string, the schema needs float"),
    ("shard-truncated", lambda t, _: _shard_truncated(t), CorruptObjectError, r"file://.*/rollouts/step_000003/shard-00000\.arrow: size is \d+ bytes but _COMMITTED records \d+"),
    ("shard-bit-flip", lambda t, _: _shard_flipped(t), CorruptObjectError, r"file://.*/shard-00000\.arrow: xxh3_128 is [0-9a-f]+ but _COMMITTED records [0-9a-f]+"),
    ("shard-not-arrow", lambda t, _: _shard_not_arrow(t), CorruptObjectError, r"file://.*/shard-00000\.arrow: not a readable Arrow IPC file: .*"),
    ("shard-missing-marker", lambda t, _: _shard_no_marker(t), NotCommittedError, r"file://.*/rollouts/step_000003: no _COMMITTED marker: still being written, or its writer died"),
    ("trainer-token-outside-vocab", lambda t, _: _trained(t, {"token_ids": [1, 2, 300, 4]}), RolloutDataError, r"rollouts step 3, row 1: token id 300 is outside the model's vocabulary \(size 256\).*"),
    ("trainer-longer-than-seq-len", lambda t, _: _trained(t, {"token_ids": list(range(10)), "loss_mask": [True] * 10, "logprobs": [-0.1] * 10}, seq_len=8), RolloutDataError, r"rollouts step 3, row 1: 10 tokens exceed seq_len=8; raise seq_len or set trainer\.truncate = true"),
    ("trainer-zero-temperature", lambda t, _: _trained(t, {"temperature": 0.0}), RolloutDataError, r"rollouts step 3, row 1: temperature 0\.0 must be > 0 .*"),
    ("trainer-empty-sequence", lambda t, _: _trained(t, {"token_ids": [], "loss_mask": [], "logprobs": []}), RolloutDataError, r"rollouts step 3, row 1: no tokens"),
    ("checkpoint-truncated", lambda t, _: _ckpt_truncated(t), CorruptObjectError, r"file://.*/checkpoints/step_000002/model\.safetensors: size is \d+ bytes but _COMMITTED records \d+"),
    ("checkpoint-bit-flip", lambda t, _: _ckpt_flipped(t), CorruptObjectError, r"file://.*/checkpoints/step_000002/config\.json: xxh3_128 is .* but _COMMITTED records .*"),
    ("checkpoint-missing-file", lambda t, _: _ckpt_missing_file(t), CorruptObjectError, r"file://.*/checkpoints/step_000002/model\.safetensors: listed in _COMMITTED but missing"),
    ("checkpoint-missing-marker", lambda t, _: _ckpt_no_marker(t), NotCommittedError, r"file://.*/checkpoints/step_000002: no _COMMITTED marker: still being written, or its writer died"),
    ("checkpoint-malformed-marker", lambda t, _: _ckpt_bad_marker(t), CorruptObjectError, r"file://.*/checkpoints/step_000002/_COMMITTED: malformed commit marker: .*"),
    ("checkpoint-local-folder-missing", lambda t, _: _local_checkpoint_missing(t), CheckpointError, r".*ckpt.*does not exist.*"),
    ("plugin-module-missing", lambda t, _: CustomPluginConfig(import_path="no_such_pkg.mod:fn").load("trainer.loss"), ValueError, r"trainer\.loss\.import_path: cannot import 'no_such_pkg\.mod': No module named 'no_such_pkg'"),
    ("plugin-attribute-missing", lambda t, _: CustomPluginConfig(import_path="math:no_such_fn").load("orchestrator.advantage"), ValueError, r"orchestrator\.advantage\.import_path: 'math' has no attribute 'no_such_fn'"),
    ("plugin-not-callable", lambda t, _: CustomPluginConfig(import_path="math:pi").load("trainer.loss"), ValueError, r"trainer\.loss\.import_path: 'math:pi' is not callable"),
    ("storage-uri-scheme", lambda t, _: ObjectStore("ftp://host/runs"), ValueError, r"unsupported storage URI 'ftp://host/runs': use one of \('file', 'memory', 's3', 'gs'\)"),
    ("storage-uri-no-bucket", lambda t, _: ObjectStore("s3://"), ValueError, r"s3:// URI needs a bucket, e\.g\. s3://bucket/prefix"),
    ("storage-options-secret", lambda t, _: ObjectStore("s3://bucket/runs", storage_options={"key": "AKIA", "secret": "shh"}), ValueError, r"storage options must not carry credentials \(key, secret\); set them in the environment .*"),
    ("storage-options-nested-secret", lambda t, _: ObjectStore("s3://bucket/runs", storage_options={"client_kwargs": {"aws_secret_access_key": "shh"}}), ValueError, r"storage options must not carry credentials \(aws_secret_access_key\).*"),
    ("storage-region-on-file", lambda t, _: ObjectStore(f"file://{t}", region="eu-west-1"), ValueError, r"endpoint_url and region apply to s3:// and gs://, not 'file://.*'"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("apply", "error", "message"),
    [pytest.param(a, e, m, id=i) for i, a, e, m in ERROR_CASES],
)
def test_bad_input_is_refused_in_one_line_naming_it(
    apply: Callable[[Path, Any], None],
    error: type[Exception],
    message: str,
    tmp_path: Path,
    tokenizer: Any,
) -> None:
    with pytest.raises(error) as caught:
        apply(tmp_path, tokenizer)
    text = str(caught.value)
    assert "\n" not in text, text
    assert _fullmatch(message, text), text


# ------------------------------------------------------------- counted and skipped


def _turn(completion: tuple[int, ...]) -> Turn:
    return Turn((1, 2), completion, tuple(-0.1 for _ in completion), 0, "stop", "")


#: (case id, the bad rollout, the skip reason it is counted under). The run goes on.
SKIP_CASES: list[tuple[str, Rollout, str]] = [
    ("env-reward-raises", Rollout("e", 1, [_turn((3,))], error="scoring failed: ZeroDivisionError: division by zero"), "env_error"),
    ("env-setup-raises", Rollout("e", 1, [], error="RuntimeError: environment bug on example 1"), "env_error"),
    ("env-reward-nan", Rollout("e", 1, [_turn((3,))], reward=math.nan), "nan_reward"),
    ("env-reward-inf", Rollout("e", 1, [_turn((3,))], reward=math.inf), "nan_reward"),
    ("empty-completion", Rollout("e", 1, [_turn(())], reward=1.0), "empty_completion"),
    ("no-turns", Rollout("e", 1, [], reward=1.0), "empty_completion"),
    ("prompt-longer-than-context", Rollout("e", 1, [], context_exhausted=True), "prompt_too_long"),
]  # fmt: skip


@pytest.mark.parametrize(("bad", "reason"), [pytest.param(b, r, id=i) for i, b, r in SKIP_CASES])
def test_unusable_rollouts_are_counted_and_skipped(bad: Rollout, reason: str) -> None:
    good = [
        Rollout("e", 0, [_turn((3, 4))], reward=1.0),
        Rollout("e", 0, [_turn((5,))], reward=0.0),
    ]
    group = build_group([*good, bad], group_id=0, temperature=1.0, advantage_fn=group_relative)
    assert group.skipped == {reason: 1}
    assert group.rollouts == 3
    assert [s.reward for s in group.samples] == [1.0, 0.0]
    assert [s.advantage for s in group.samples] == [0.5, -0.5]


#: (case id, how the env's reward function misbehaves, skip reason, the rollouts' error or None)
ENV_CASES: list[tuple[str, str, str, str | None]] = [
    ("env-reward-function-raises", "raise", "env_error", "scoring failed: reward function broken: reward of an empty answer"),
    ("env-reward-function-nan", "nan", "nan_reward", None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("mode", "reason", "error"), [pytest.param(m, r, e, id=i) for i, m, r, e in ENV_CASES]
)
def test_a_misbehaving_reward_function_skips_its_group(
    mode: str, reason: str, error: str | None, policy: Any, generator: Any
) -> None:
    """Played for real: a verifiers env, the tiny tokenizer, a policy that answers correctly."""
    env = load_environment(
        EnvConfig(id="tests.unit.reliability.bad_reward_env", args={"reward": mode})
    )
    play = generator(policy(last_user_text))
    played = asyncio.run(
        env.run_group(env.tasks("train")[0], 2, play, SamplingConfig(max_tokens=16))
    )
    assert [r.error for r in played] == [error, error]
    assert all(len(r.turns) == 1 for r in played)
    group = build_group(played, group_id=0, temperature=1.0, advantage_fn=group_relative)
    assert group.skipped == {reason: 2}
    assert group.samples == []


# ----------------------------------------------------------------------- the docs table


def test_docs_list_exactly_these_cases() -> None:
    """docs/reliability.md's bad-input tables are written by hand; this keeps them honest."""
    doc = (Path(__file__).resolve().parents[3] / "docs" / "reliability.md").read_text()
    section = doc.split("## 3. Bad input", 1)[1]
    documented = re.findall(r"^\| `([a-z0-9-]+)` \|", section, re.M)
    ids = (
        [c[0] for c in CONFIG_CASES]
        + [c[0] for c in ERROR_CASES]
        + [c[0] for c in SKIP_CASES]
        + [c[0] for c in ENV_CASES]
    )
    assert len(ids) == len(set(ids)) >= 40
    assert documented == ids
