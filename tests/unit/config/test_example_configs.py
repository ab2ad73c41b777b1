"""The shipped configs under configs/: each resolves (`--dry-run`), and each says what it claims.

Every TOML file under configs/ must appear in `COMBINATIONS` (overlays composed on the file
they extend), so a new config is validated the day it lands.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.config import PrimeflowConfig, load_config
from engine.envs import alphabet_sort
from engine.envs.reverse_text import SYSTEM_PROMPT, make_splits, prompt_messages, sft_examples
from engine.models.char_tokenizer import write_tokenizer
from engine.models.tiny import TinyModelSpec, write_tiny_model
from flows.cli import main

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "configs"

#: (command, config files composed left to right): every shipped config and overlay.
COMBINATIONS: list[tuple[str, tuple[str, ...]]] = [
    ("pipeline", ("reverse_text/pipeline.toml",)),
    ("pipeline", ("debug/tiny.toml",)),
    ("pipeline", ("reverse_text/pipeline.toml", "debug/storage_s3.toml")),
    ("sft", ("debug/sft.toml",)),
    ("rl", ("debug/rl.toml",)),
    ("pipeline", ("qwen3_0_6b/reverse_text.toml",)),
    ("pipeline", ("qwen3_0_6b/reverse_text.toml", "qwen3_0_6b/one_gpu.toml")),
    ("pipeline", ("reverse_text/gpu.toml",)),
    ("pipeline", ("alphabet_sort/lora.toml",)),
    ("pipeline", ("agentic/tool_math.toml",)),
    ("pipeline", ("agentic/corpus_search.toml",)),
    ("pipeline", ("agentic/wordle.toml",)),
    ("pipeline", ("agentic/tool_math.toml", "agentic/on_gpu.toml")),
    ("pipeline", ("agentic/tool_math.toml", "agentic/on_gpu.toml", "agentic/tool_math_gpu.toml")),
    ("pipeline", ("agentic/corpus_search.toml", "agentic/on_gpu.toml")),
    (
        "pipeline",
        ("agentic/corpus_search.toml", "agentic/on_gpu.toml", "agentic/corpus_search_gpu.toml"),
    ),
    ("pipeline", ("agentic/wordle.toml", "agentic/on_gpu.toml")),
    ("sft", ("multi_tenant/base.toml",)),
    ("pools up", ("multi_tenant/pools.toml",)),
    ("pipeline", ("multi_tenant/tenant.toml", "multi_tenant/reverse_text.toml")),
    ("pipeline", ("multi_tenant/tenant.toml", "multi_tenant/alphabet_sort.toml")),
]


def _args(files: tuple[str, ...]) -> list[str]:
    return [token for file in files for token in ("@", str(CONFIGS / file))]


def load(*files: str) -> PrimeflowConfig:
    return load_config(_args(files))


def test_every_shipped_config_is_covered() -> None:
    shipped = {str(path.relative_to(CONFIGS)) for path in CONFIGS.rglob("*.toml")}
    covered = {file for _, files in COMBINATIONS for file in files}
    assert shipped == covered


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder to run the commands from, holding the shared pools' base (base.toml's result,
    which the tenant configs name by its path) as a model folder."""
    folder = tmp_path_factory.mktemp("checkout")
    write_tiny_model(folder / load("multi_tenant/pools.toml").model.name, TinyModelSpec())
    return folder


@pytest.mark.parametrize(("command", "files"), COMBINATIONS, ids=lambda v: str(v))
def test_dry_run_resolves(
    command: str, files: tuple[str, ...], checkout: Path, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(checkout)
    assert main([*command.split(), *_args(files), "--dry-run"]) == 0
    resolved = json.loads(capsys.readouterr().out)
    assert PrimeflowConfig.model_validate(resolved).model_dump(mode="json") == resolved


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(folder, model_max_length=4096)
    return AutoTokenizer.from_pretrained(str(folder))


def _prompt_len(tokenizer, text: str, system_prompt: str) -> int:
    ids = tokenizer.apply_chat_template(
        prompt_messages(text, system_prompt),
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    return len(ids)


def _system_prompt(args: dict) -> str:
    return args.get("system_prompt", SYSTEM_PROMPT)


@pytest.mark.parametrize(
    "files",
    [
        ("reverse_text/pipeline.toml",),
        ("debug/tiny.toml",),
        ("reverse_text/gpu.toml",),
        ("multi_tenant/tenant.toml", "multi_tenant/reverse_text.toml"),
    ],
)
def test_reverse_text_samples_fit_the_context(files: tuple[str, ...], tiny_tokenizer) -> None:
    """No prompt + max_tokens and no SFT conversation is cut by seq_len (nothing truncated)."""
    config = load(*files)
    assert not config.trainer.truncate
    train, held_out = make_splits(2000, config.eval.num_examples, seed=config.run.seed)
    for section, texts in ((config.orchestrator, train), (config.eval, held_out)):
        (env,) = section.envs
        prompt = _system_prompt(env.args)
        longest_prompt = max(_prompt_len(tiny_tokenizer, text, prompt) for text in texts)
        assert longest_prompt + section.sampling.max_tokens <= config.seq_len
    sft_prompt = _system_prompt(config.sft.data.env_args)
    longest_sft = max(
        len(tiny_tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=False))
        for row in sft_examples(2000, seed=config.run.seed, system_prompt=sft_prompt)
    )
    assert longest_sft <= config.seq_len
    if files != ("reverse_text/pipeline.toml",):
        return
    # Gold answers are short enough for max_tokens, so a perfect policy can score 1.
    longest_answer = max(len(text) for text in train + held_out) + len(
        "<reversed_text></reversed_text><|im_end|>"
    )
    assert longest_answer <= config.orchestrator.sampling.max_tokens


def test_reverse_text_demo_measures_what_the_issue_asks() -> None:
    config = load("reverse_text/pipeline.toml")
    assert config.model.name == "primeflow/tiny-qwen3"
    assert config.storage.uri == "file://./runs"
    assert config.inference.num_servers == 1 and config.trainer.parallel.nproc_per_node == 1
    assert config.sft.enabled and config.sft.data.env == "reverse-text"
    assert config.orchestrator.max_async_level == 1
    # Eval at the training temperature on >= 200 held-out samples, greedy as well.
    assert config.eval.sampling.temperature == config.orchestrator.sampling.temperature
    assert config.eval.num_examples * config.eval.rollouts_per_example >= 200
    assert config.eval.num_examples >= 200 and config.eval.greedy
    # One micro-batch per SFT step: the batch's rows fit micro_batch_tokens.
    assert config.trainer.micro_batch_tokens is not None
    assert config.trainer.micro_batch_tokens >= config.sft.batch_size * config.seq_len
    # SFT, RL and evaluation pose the same task: one system prompt for all three.
    prompts = {_system_prompt(config.sft.data.env_args)}
    prompts |= {_system_prompt(env.args) for env in (*config.orchestrator.envs, *config.eval.envs)}
    assert len(prompts) == 1
    # SFT ends on a decayed learning rate (a constant one left greedy at 0.70, not 0.885), and a
    # reply that never ends scores 0 (the end-of-turn drift, docs/algorithms.md).
    assert config.sft.scheduler.type == "cosine"
    assert config.orchestrator.truncated_reward == 0.0


def test_gpu_demo_is_the_cpu_task_on_one_gpu_with_room_left_for_rl() -> None:
    config, cpu = load("reverse_text/gpu.toml"), load("reverse_text/pipeline.toml")
    assert config.model.name == "primeflow/qwen3-char-76m"
    assert config.inference.device == "cuda" and config.trainer.dtype == "bfloat16"
    assert config.inference.gpu_ids == config.trainer.parallel.gpu_ids == [0]
    assert config.trainer.cpu_cores is None and config.inference.cpu_cores == []
    # The same task, sampling and evaluation as the CPU demo; the CPU demo's prompt is shorter
    # (every prompt token costs its trainer on 2 cores), so its context is too, and its batch
    # is 64 prompts × 4 (the 0.44M model's greedy answer fell at 16 × 8). The GPU keeps every
    # rollout the async bound allows in flight (the batch being built and the next).
    sampler = config.orchestrator
    assert sampler.max_concurrent == (sampler.max_async_level + 1) * sampler.batch_size
    differ = {"model", "seq_len", "max_steps", "advantage", "truncated_reward", "envs",
              "batch_size", "rollouts_per_example"}  # fmt: skip
    same = {"exclude": differ | {"max_concurrent"}}
    for section in ("orchestrator", "eval"):
        gpu_side, cpu_side = getattr(config, section), getattr(cpu, section)
        assert gpu_side.model_dump(**same) == cpu_side.model_dump(**same), section
        assert [e.id for e in gpu_side.envs] == [e.id for e in cpu_side.envs], section
    assert config.sft.data.env == cpu.sft.data.env
    # From 20,000 demonstrations SFT learns the task outright (greedy 1.000 on the GPU model,
    # 0.885 on the CPU one): both demos' SFT sees few, so that RL has something to add
    # (docs/benchmarks.md).
    assert config.sft.data.num_examples <= 256 and cpu.sft.data.num_examples <= 256
    assert config.orchestrator.advantage.std_normalize
    assert config.orchestrator.truncated_reward == 0.0


def test_tiny_debug_pipeline_stays_small() -> None:
    config = load("debug/tiny.toml")
    assert config.sft.max_steps <= 5 and config.max_steps <= 3
    assert config.orchestrator.batch_size <= 16 and config.eval.num_examples <= 16


def test_debug_smoke_configs_are_small_and_offline() -> None:
    sft = load("debug/sft.toml")
    assert sft.model.name == "primeflow/tiny-qwen3" and sft.sft.data.path is None
    assert sft.sft.max_steps * sft.sft.batch_size <= 64
    rl = load("debug/rl.toml")
    assert rl.model.name == "primeflow/tiny-qwen3"
    assert rl.max_steps <= 2 and rl.orchestrator.batch_size <= 8


def test_qwen3_two_gpus_one_for_inference_one_for_the_trainer() -> None:
    config = load("qwen3_0_6b/reverse_text.toml")
    assert config.model.name == "Qwen/Qwen3-0.6B"
    assert config.inference.device == "cuda" and config.trainer.dtype == "bfloat16"
    assert config.inference.gpu_ids == [0] and config.trainer.parallel.gpu_ids == [1]
    assert config.sft.enabled and config.sft.data.path is not None
    assert config.orchestrator.max_async_level == 1
    assert config.orchestrator.batch_size % config.orchestrator.rollouts_per_example == 0


def test_qwen3_one_gpu_overlay_shares_the_card() -> None:
    config = load("qwen3_0_6b/reverse_text.toml", "qwen3_0_6b/one_gpu.toml")
    assert config.inference.gpu_ids == config.trainer.parallel.gpu_ids == [0]
    assert config.inference.gpu_memory_utilization <= 0.5
    base = load("qwen3_0_6b/reverse_text.toml")
    # Everything but placement and micro-batching is the two-GPU recipe.
    changed = {"inference", "trainer"}
    for field in PrimeflowConfig.model_fields:
        if field not in changed:
            assert getattr(config, field) == getattr(base, field), field
    assert config.trainer.optim == base.trainer.optim
    assert config.inference.model == base.inference.model


def test_alphabet_sort_lora_example_warms_every_weight_then_trains_an_adapter(
    tiny_tokenizer,
) -> None:
    """Issue 18's LoRA example: multi-turn alphabet-sort, a full-weight SFT warm-up (LoRA
    cannot move the random tiny model), LoRA RL on its result, held-out before and after."""
    config = load("alphabet_sort/lora.toml")
    assert config.model.name == "primeflow/tiny-qwen3" and config.trainer.lora is not None
    assert config.sft.enabled and config.sft.full_weights
    assert config.sft.data.env == "alphabet-sort"
    assert [env.id for env in config.orchestrator.envs] == ["alphabet-sort"]
    assert [env.id for env in config.eval.envs] == ["alphabet-sort"]
    assert config.eval.sampling.temperature == config.orchestrator.sampling.temperature
    # Nothing is cut: the longest SFT conversation, and the longest two-turn rollout (prompt,
    # both replies at max_tokens, the second user turn), fit seq_len.
    rows = alphabet_sort.sft_examples(2000, seed=config.run.seed)
    longest = max(
        len(tiny_tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=False))
        for row in rows
    )
    assert longest <= config.seq_len
    worst = max(
        len(
            tiny_tokenizer.apply_chat_template(
                [m if m["role"] == "user" else {**m, "content": ""} for m in row["messages"]],
                tokenize=True,
                return_dict=False,
            )
        )
        for row in rows
    )
    assert worst + 2 * config.orchestrator.sampling.max_tokens <= config.seq_len
    assert config.trainer.micro_batch_tokens is not None
    assert config.trainer.micro_batch_tokens >= config.sft.batch_size * config.seq_len


def test_servers_get_three_adapter_slots_a_lineage() -> None:
    """Each tenant (or a LoRA run of its own) needs its served version, the one before and the
    one being added in GPU slots at once, or vLLM evicts adapters still in use."""
    pools = load("multi_tenant/pools.toml")
    assert pools.inference.lora is not None
    assert (pools.inference.lora.max_loras, pools.inference.lora.max_cpu_loras) == (6, 12)
    own = load("alphabet_sort/lora.toml")
    assert own.inference.lora is not None and own.inference.lora.max_loras == 3
