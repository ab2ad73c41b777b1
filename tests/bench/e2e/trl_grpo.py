"""TRL's GRPOTrainer on the reverse-text demo: the baseline of `bench_trl.py`.

Runs in TRL's own virtual environment (never primeflow's): it imports nothing of primeflow.
`bench_trl.py` writes the training prompts (the demo's train split, same seed) as JSONL and
passes the SFT checkpoint folder; this script trains with the demo's batch and sampling and
prints one JSON line per step: `{"step", "time", "reward"}`, then a summary line.

The reward is reverse-text's: the character-level `difflib.SequenceMatcher` ratio between the
text inside the first `<reversed_text>` tag and the reversed text (engine/envs/reverse_text.py,
restated here because that module needs `verifiers`).
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
import time
from typing import Any

_ANSWER = re.compile(r"<reversed_text>(.*?)(?:</reversed_text>|$)", re.DOTALL)


def similarity(text: str, target: str) -> float:
    match = _ANSWER.search(text)
    if match is None:
        return 0.0
    guess = match.group(1).strip()
    return difflib.SequenceMatcher(None, guess, target, autojunk=False).ratio()


def similarity_reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    return [
        similarity(c if isinstance(c, str) else c[-1]["content"], target)
        for c, target in zip(completions, answer, strict=True)
    ]


def with_truncated_reward(max_tokens: int, eos_id: int, value: float) -> Any:
    """The reward under primeflow's `orchestrator.truncated_reward`: a reply that used all
    `max_tokens` without ending scores `value` (TRL passes each reply's ids up to its end)."""

    def similarity_reward_truncated(
        completions: list[Any], answer: list[str], completion_ids: list[list[int]], **_: Any
    ) -> list[float]:
        scores = similarity_reward(completions, answer)
        return [
            value if len(ids) >= max_tokens and ids[-1] != eos_id else score
            for score, ids in zip(scores, completion_ids, strict=True)
        ]

    return similarity_reward_truncated


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="SFT checkpoint folder (HF format)")
    parser.add_argument("--data", required=True, help="JSONL of {prompt: messages, answer}")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--rollouts-per-example", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--warmup-steps", type=int, default=0, help="linear, then constant")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument(
        "--scale-rewards",
        choices=("none", "group"),
        default="none",
        help="group: advantages over the group's std (primeflow's std_normalize)",
    )
    parser.add_argument(
        "--truncated-reward",
        type=float,
        default=None,
        help="the reward of a reply that never ended (primeflow's truncated_reward)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--target", type=float, default=None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--use-vllm", action="store_true", help="TRL's colocated vLLM (CUDA)")
    parser.add_argument("--save-every", type=int, default=0, help="save the policy every N steps")
    parser.add_argument("--save-dir", default=None, help="where: SAVE_DIR/step_000025/, ...")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(args.seed)
    with open(args.data, encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    dataset = Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    batch = args.prompts_per_step * args.rollouts_per_example
    config = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        adam_beta1=0.9,
        adam_beta2=0.999,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=args.rollouts_per_example,
        generation_batch_size=batch,
        num_iterations=1,
        max_completion_length=args.max_tokens,
        temperature=args.temperature,
        top_p=1.0,
        beta=0.0,  # no KL term, as primeflow's AIPO loss
        scale_rewards=args.scale_rewards,  # as the recipe's orchestrator.advantage.std_normalize
        loss_type="dapo",  # token-level mean over the batch, as primeflow
        # Without --use-vllm TRL generates with transformers (on a CPU machine it must).
        use_vllm=args.use_vllm,
        **({"vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.2} if args.use_vllm else {}),
        bf16=cuda,
        fp16=False,
        use_cpu=not cuda,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        dataloader_num_workers=0,
        log_completions=False,
    )
    start = time.time()
    history: list[dict[str, float]] = []

    class Log(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                line = {"step": state.global_step, "time": time.time() - start}
                line["reward"] = float(logs["reward"])
                # What primeflow's `learning_health` reads from its own metrics, where TRL has it.
                for key in ("grad_norm", "entropy", "frac_reward_zero_std"):
                    if key in logs:
                        line[key] = float(logs[key])
                history.append(line)
                print(json.dumps(line), flush=True)

        def on_step_end(self, _args, state, control, model=None, **kwargs):
            """Save the policy every --save-every steps, its save time left off the clock."""
            nonlocal start
            if args.save_every and state.global_step % args.save_every == 0 and model is not None:
                began = time.time()
                folder = f"{args.save_dir}/step_{state.global_step:06d}"
                model.save_pretrained(folder, safe_serialization=True)
                tokenizer.save_pretrained(folder)
                start += time.time() - began
                print(json.dumps({"saved": state.global_step, "folder": folder}), flush=True)

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[
            similarity_reward
            if args.truncated_reward is None
            else with_truncated_reward(
                args.max_tokens, tokenizer.eos_token_id, args.truncated_reward
            )
        ],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Log()],
    )
    trainer.train()
    wall = time.time() - start
    summary = {"summary": True, "steps": len(history), "wall_s": wall}
    if history:
        summary["steps_per_s"] = (
            (len(history) - 1) / (history[-1]["time"] - history[0]["time"])
            if len(history) > 1
            else 0.0
        )
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
