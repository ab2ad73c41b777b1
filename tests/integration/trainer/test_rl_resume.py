"""Exact resume, checkpoint format, and the rollout wait/validation errors (single process)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from engine.run import run_store as open_run_store
from engine.trainer.rollouts import RolloutDataError, samples_from_rollouts
from engine.trainer.worker import run_stage
from storage.checkpoints import fetch_checkpoint
from storage.layout import RunLayout
from storage.metrics import read_metrics
from storage.shards import rows_to_table
from tests.integration.trainer.conftest import make_config, rollout_rows, write_steps


def checkpoint_weights(config, step: int) -> dict[str, torch.Tensor]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = fetch_checkpoint(open_run_store(config), step, Path(tmp) / "ckpt")
        return load_file(str(folder / "model.safetensors"))


def test_resume_from_step_k_matches_an_uninterrupted_run(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    straight = make_config(tmp_path, tiny_model_dir, "straight")
    write_steps(straight, range(1, 4))
    run_stage(straight, "rl")

    # Same run, interrupted: only steps 1-2 exist, so the trainer trains them, commits their
    # checkpoints and then fails waiting for step 3 with a clear timeout.
    broken = make_config(tmp_path, tiny_model_dir, "resumed", trainer={"rollout_timeout_s": 0.5})
    write_steps(broken, range(1, 3))
    with pytest.raises(TimeoutError, match=r"no rollouts for step 3 .* after 0\.5s"):
        run_stage(broken, "rl")
    # A half-written checkpoint 3 (no marker) must be ignored on resume.
    store = open_run_store(broken)
    store.write_bytes(f"{RunLayout.checkpoint_dir(3)}/model.safetensors", b"partial")
    write_steps(broken, range(3, 4))
    resumed = make_config(tmp_path, tiny_model_dir, "resumed")
    run_stage(resumed, "rl")

    expected = read_metrics(open_run_store(straight), "rl")
    got = read_metrics(store, "rl")
    assert [m["step"] for m in got] == [1, 2, 3]
    for key in ("loss", "grad_norm", "lr", "entropy", "mismatch_kl"):
        # fp32 on CPU, same reduction order: the resumed step is bitwise the same.
        assert got[2][key] == expected[2][key], key
    assert expected[2]["lr"] == pytest.approx(1e-3 * 0.1)  # the linear schedule's last step
    want, have = checkpoint_weights(straight, 3), checkpoint_weights(resumed, 3)
    assert want.keys() == have.keys()
    for name in want:
        torch.testing.assert_close(have[name], want[name], rtol=0, atol=0, msg=name)


def test_checkpoint_is_a_transformers_folder_matching_the_trainer(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = make_config(tmp_path, tiny_model_dir, "hf", max_steps=1)
    write_steps(config, range(1, 2))
    run_stage(config, "rl")
    with tempfile.TemporaryDirectory() as tmp:
        folder = fetch_checkpoint(open_run_store(config), 1, Path(tmp) / "ckpt", trainer_state=True)
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        stored = load_file(str(folder / "model.safetensors"))
        state = json.loads((folder / "trainer" / "progress.json").read_text())
        assert (folder / "tokenizer.json").is_file()
    # Every stored tensor is the model's parameter as transformers loaded it (tied head included).
    params = dict(model.named_parameters())
    for name, tensor in stored.items():
        torch.testing.assert_close(params[name].detach(), tensor, rtol=0, atol=0)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    original = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    moved = max(
        (params[n].detach() - p.detach()).abs().max().item() for n, p in original.named_parameters()
    )
    assert 0 < moved < 1e-2, "one AdamW step at lr 1e-3 moves weights by about lr"
    assert state["step"] == 1 and state["data"] == {"rollout_step": 1}


def test_bad_rollouts_fail_with_the_row_and_the_reason() -> None:
    rows = rollout_rows(1, num=3)
    rows[2]["token_ids"][0] = 500
    with pytest.raises(RolloutDataError, match=r"step 1, row 2: token id 500 is outside .* 101"):
        samples_from_rollouts(
            rows_to_table(rows), step=1, vocab_size=101, seq_len=64, allow_truncation=False
        )
    long = rollout_rows(1, num=1)
    long[0].update(token_ids=[5] * 70, loss_mask=[True] * 70, logprobs=[-1.0] * 70)
    table: pa.Table = rows_to_table(long)
    with pytest.raises(RolloutDataError, match="70 tokens exceed seq_len=64"):
        samples_from_rollouts(table, step=1, vocab_size=101, seq_len=64, allow_truncation=False)
    (sample,) = samples_from_rollouts(
        table, step=1, vocab_size=101, seq_len=64, allow_truncation=True
    )
    assert len(sample) == 64
