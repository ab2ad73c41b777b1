"""primeflow against a reference GRPO (TRL's `GRPOTrainer`) on one recipe: held-out reward
against RL step and against wall time, both measured the same way.

Same SFT checkpoint, train prompts (the reverse-text train split, the run's seed), samples per
step (prompts × group), sampling, learning rate and warm-up, AdamW, gradient clipping, no KL,
group-mean baseline, token-level loss. primeflow runs its `rl` stage (async, as configured); TRL
runs in its own Python (`--trl-python`: a virtual environment with TRL, never primeflow's),
generating with transformers or, with `--trl-vllm`, its colocated vLLM. Both keep their policy
every `--eval-every` steps, and afterwards one vLLM pool evaluates every kept policy on the same
held-out prompts with the config's `eval` settings (greedy and sampled), so the two curves
differ only by the trainer. Wall time is each trainer's own clock from its first step's start
(model loading and TRL's policy saves left out; primeflow's inference pool was already up, as
in the pipeline).

The headline is the issue's test: the reference's held-out greedy reward at its last step, G;
the first step and time at which primeflow's curve reaches G; and those over the reference's
(issue 30's targets: ≤ 1.0× the steps and ≤ 0.5× the time). The figure puts greedy and sampled
reward against step (left) and against wall time (right) for both. `--arm NAME=FLAGS` adds
primeflow arms (one after another, each alone on the pool, from the same SFT policy; an arm
that changes `--inference.*` gets a pool of its own while it runs) to the one TRL run, each with
its own curve and headline (`headlines`). They run after the recipe's arm and TRL, so that the
headline comes first on a device that may be taken back; an arm that fails is recorded under
`failed` and the next one runs. E.g. the next comparison:

    python -m tests.bench.e2e.bench_reference --config configs/reverse_text/gpu.toml \
        --sft-steps 100 --steps 150 --trl-python python3 \
        --arm 'on-policy=--orchestrator.max-async-level 0'

    python -m tests.bench.e2e.bench_reference --config configs/reverse_text/gpu.toml \
        --sft-steps 100 --steps 300 --trl-python python3 --out reference.json
    # on the GPU machine (no package index) TRL is carried as its wheel: `pip download
    # trl==1.16.0 --no-deps` here, carry it, and after ../shared/gpu-vllm's install.sh:
    #   pip install --no-index --no-deps --target /tmp/site trl-1.16.0-py3-none-any.whl
    # the instrument on a CPU machine (TRL in /tmp/trl-venv: pip install torch==2.13.0 trl):
    python -m tests.bench.e2e.bench_reference --sft-steps 20 --steps 4 --eval-every 2 \
        --trl-python /tmp/trl-venv/bin/python -- --eval.num-examples 8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.config import PrimeflowConfig, load_config, with_overrides
from engine.envs.reverse_text import SYSTEM_PROMPT
from engine.inference.pool import InferencePool
from engine.local_checkpoints import local_checkpoint
from engine.models.tiny import default_cache_dir
from engine.orchestrator.main import evaluate_policy
from engine.run import local_run_dir, open_run, run_store
from engine.stages import run_rl
from storage.layout import RunLayout
from storage.metrics import read_metrics
from storage.store import ObjectStore
from tests.bench.e2e.bench_async import save, train_sft
from tests.bench.e2e.bench_learning import learning_health, loop_timing
from tests.bench.e2e.bench_trl import HERE, json_lines, write_prompts

DEMO = Path(__file__).resolve().parents[3] / "configs/reverse_text/pipeline.toml"
#: The name of primeflow's arm that runs the recipe as it is.
PRIMEFLOW = "primeflow"


def recipe(
    args: argparse.Namespace, workdir: Path, name: str = PRIMEFLOW, flags: Sequence[str] = ()
) -> PrimeflowConfig:
    """The recipe for primeflow's arm `name`: the config files, the run's bookkeeping, the
    recipe's overrides (after `--`), then the arm's own `flags`."""
    files = [item for path in args.config for item in ("@", str(path))]
    config = load_config(
        [
            *files,
            "--storage.uri", f"file://{workdir}",
            "--run.name", name,
            "--max-steps", str(args.steps),
            "--sft.max-steps", str(args.sft_steps),
            # Keep a checkpoint every --eval-every steps for the evaluation afterwards.
            "--trainer.checkpoint.interval", str(args.eval_every),
            "--trainer.checkpoint.keep-last", "1",
            "--trainer.checkpoint.keep-every", str(args.eval_every),
            *args.overrides,
            *flags,
        ]
    )  # fmt: skip
    # Every kept policy is evaluated afterwards: evaluations during RL (the demo's eval.interval)
    # would only hold reloads on primeflow's clock, which TRL's does not pay.
    return with_overrides(config, {"eval.interval": None})


def primeflow_clock(config: PrimeflowConfig) -> dict[int, float]:
    """Seconds from the trainer's first step's start (its wait for the first rollouts) to
    the end of each step."""
    lines = read_metrics(run_store(config), "rl")
    origin = lines[0]["time"] - lines[0]["step_seconds"] - lines[0]["wait_seconds"]
    return {0: 0.0, **{line["step"]: line["time"] - origin for line in lines}}


def run_reference(
    args: argparse.Namespace, config: PrimeflowConfig, sft: Path, workdir: Path
) -> tuple[dict[int, float], dict[int, Path], dict[str, float | None]]:
    """TRL on the recipe: its clock per step, the folders of its kept policies and what its
    logs say of its updates' health."""
    orchestrator = config.orchestrator
    data = workdir / "prompts.jsonl"
    (env,) = orchestrator.envs  # the recipe: one reverse-text environment
    system_prompt = env.args.get("system_prompt", SYSTEM_PROMPT)
    write_prompts(data, 10_000, config.run.seed, system_prompt)
    saves = workdir / "trl-policies"
    command = [
        args.trl_python, str(HERE / "trl_grpo.py"),
        f"--model={sft}", f"--data={data}", f"--steps={args.steps}",
        f"--lr={config.trainer.optim.lr}",
        f"--warmup-steps={config.trainer.scheduler.warmup_steps}",
        f"--weight-decay={config.trainer.optim.weight_decay}",
        f"--max-grad-norm={config.trainer.optim.max_grad_norm or 0}",
        f"--prompts-per-step={orchestrator.batch_size // orchestrator.rollouts_per_example}",
        f"--rollouts-per-example={orchestrator.rollouts_per_example}",
        f"--max-tokens={orchestrator.sampling.max_tokens}",
        f"--temperature={orchestrator.sampling.temperature}",
        f"--scale-rewards={'group' if orchestrator.advantage.std_normalize else 'none'}",
        *([] if orchestrator.truncated_reward is None
          else [f"--truncated-reward={orchestrator.truncated_reward}"]),
        f"--seed={config.run.seed}", f"--output-dir={workdir / 'trl-out'}",
        f"--device={'cuda' if config.inference.device == 'cuda' else 'cpu'}",
        f"--save-every={args.eval_every}", f"--save-dir={saves}",
        *(["--use-vllm"] if args.trl_vllm else []),
    ]  # fmt: skip
    with (workdir / "trl.log").open("w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    if code != 0:
        raise RuntimeError(f"TRL failed ({code}); see {workdir / 'trl.log'}")
    lines = json_lines((workdir / "trl.log").read_text())
    steps = [e for e in lines if "reward" in e]
    clock = {0: 0.0, **{e["step"]: e["time"] for e in steps}}
    kept = {e["saved"]: Path(e["folder"]) for e in lines if "saved" in e}
    return clock, kept, reference_health(steps)


def reference_health(steps: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """The reference's side of `learning_health`, from what TRL logs each step."""
    renamed = [
        {"reward/mean": e["reward"], "advantage/zero_group_fraction": e.get("frac_reward_zero_std")}
        for e in steps
    ]
    health = learning_health(steps, renamed)
    return {key: value for key, value in health.items() if value is not None}


def evaluate_kept(
    config: PrimeflowConfig,
    pool: InferencePool,
    store: ObjectStore,
    name: str,
    policies: dict[int, str | Path],
    clock: dict[int, float],
) -> list[dict[str, Any]]:
    """Held-out reward of each kept policy (`eval/<name>/step_N` under `store`), in step order."""
    curve = []
    for step, policy in sorted(policies.items()):
        pool.reload(policy, version=step)
        summary = evaluate_policy(config, store, pool, name=name, stage="rl", step=step).summary
        curve.append(
            {
                "step": step,
                "time": clock.get(step),
                "greedy": summary.get("greedy/avg@1"),
                "sampled": summary[f"avg@{summary['k']}"],
            }
        )
    return curve


def run_arm(
    config: PrimeflowConfig, pool: InferencePool, sft: Path, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """One primeflow arm from the SFT policy: its RL stage as the `rl` flow runs it (a trainer
    that dies fails the arm at once, where an orchestrator on its own would wait an hour for
    its next policy), then every kept policy evaluated."""
    pool.reload(sft, version=0)
    run_rl(config, open_run(config, command=["bench_reference", config.run.name]), pool)
    store = run_store(config)
    every = {*range(args.eval_every, args.steps + 1, args.eval_every), args.steps}
    kept = {0: sft, **{s: store.url(RunLayout.checkpoint_dir(s)) for s in sorted(every)}}
    return evaluate_kept(config, pool, store, "held-out", kept, primeflow_clock(config))


class OnePool:
    """The pool the work at hand samples from, one pool up at a time: an arm whose inference
    settings differ from the pool up (more servers on the GPU, say) stops it and starts its
    own, and the recipe's comes back for what needs it after. Without it an arm's
    `--inference.*` flags would be silently ignored; with the recipe's pool left up beside an
    arm's own, three servers beside four ran the GPU out of memory (the thirteenth session's
    `four-servers` arm)."""

    def __init__(self) -> None:
        self._pool: InferencePool | None = None

    def __enter__(self) -> OnePool:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.stop()
            self._pool = None

    def of(self, config: PrimeflowConfig) -> InferencePool:
        """A pool with `config`'s inference settings, started if the one up has others."""
        if self._pool is not None and self._pool.config == config.inference:
            return self._pool
        self.close()
        pool = InferencePool.for_run(config, local_run_dir(config) / "logs")
        pool.start()
        self._pool = pool
        return pool


def reaching(curve: Sequence[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The first point of `curve` whose greedy reward reaches `target`."""
    return next((p for p in curve if p["greedy"] is not None and p["greedy"] >= target), None)


def headline(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> dict[str, Any]:
    """When each trainer first reached the reference's final greedy reward (after step 0)."""
    target, start = theirs[-1]["greedy"], theirs[0]["greedy"]
    found: dict[str, Any] = {"reference_final_greedy": target, "sft_greedy": start}
    if target <= start:
        found["note"] = "the reference did not improve on the SFT policy: nothing to reach"
        return found
    mine, reference = reaching(ours[1:], target), reaching(theirs[1:], target)
    if mine is None:
        found["note"] = "primeflow did not reach the reference's final greedy reward"
    if mine and reference and reference["time"]:
        found.update(
            primeflow_step=mine["step"],
            reference_step=reference["step"],
            steps_ratio=mine["step"] / reference["step"],
            primeflow_s=mine["time"],
            reference_s=reference["time"],
            time_ratio=mine["time"] / reference["time"],
        )
    return found


def figure_png(result: dict[str, Any], path: Path) -> None:
    """Held-out greedy and sampled reward against step (left) and wall time (right)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4.5), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    by_step, by_time = figure.subplots(1, 2, sharey=True)
    arms = [*(name for name in result["arms"] if name in result), "reference"]
    colors = ["tab:blue", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    for who, color in zip(arms, [*colors[: len(arms) - 1], "tab:orange"], strict=True):
        for mode, style in (("greedy", "s-"), ("sampled", "o--")):
            points = [p for p in result[who] if p[mode] is not None]
            label = f"{who}, held-out {mode}"
            by_step.plot([p["step"] for p in points], [p[mode] for p in points], style,
                         color=color, label=label, markersize=4)  # fmt: skip
            timed = [p for p in points if p["time"] is not None]
            by_time.plot([p["time"] for p in timed], [p[mode] for p in timed], style,
                         color=color, label=label, markersize=4)  # fmt: skip
    by_step.set_xlabel("RL step")
    by_time.set_xlabel("trainer wall time (s)")
    by_step.set_ylabel("held-out reward")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
    by_time.legend(fontsize=7, loc="lower right")
    figure.suptitle("primeflow against TRL's GRPOTrainer: same SFT checkpoint, prompts, batch")
    figure.savefig(path, format="png")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.e2e.bench_reference")
    parser.add_argument("--config", action="append", help="config file(s); default: the demo's")
    parser.add_argument("--sft-checkpoint", help="URI of the SFT checkpoint (else train one)")
    parser.add_argument("--sft-steps", type=int, default=100)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--trl-python", required=True, help="the Python of an env with TRL")
    parser.add_argument("--trl-vllm", action="store_true", help="TRL generates with vLLM")
    parser.add_argument(
        "--arm",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="another primeflow arm on the same SFT checkpoint, e.g. "
        "'on-policy=--orchestrator.max-async-level 0' (repeatable)",
    )
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=None, help="the JSON (and, beside it, the .png)")
    parser.add_argument("overrides", nargs="*", help="flags for the recipe, after --")
    args = parser.parse_args(argv)
    args.config = args.config or [str(DEMO)]
    workdir = Path(args.workdir or f"/tmp/bench-reference-{int(time.time())}").resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    out = Path(args.out).resolve() if args.out else workdir / "reference.json"
    config = recipe(args, workdir)
    sft_uri = args.sft_checkpoint or train_sft(config)
    init = {"trainer.init_checkpoint": sft_uri}
    config = with_overrides(config, init)
    sft = local_checkpoint(sft_uri, default_cache_dir())
    flags = {PRIMEFLOW: [], **{name: f.split() for name, f in (a.split("=", 1) for a in args.arm)}}
    arms = {
        name: config if name == PRIMEFLOW else with_overrides(recipe(args, workdir, name, f), init)
        for name, f in flags.items()
    }
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "sft_checkpoint": sft_uri,
        "steps": args.steps,
        "recipe": config.model_dump(mode="json", include={"trainer", "orchestrator", "eval"}),
        "arms": flags,
    }
    lines: dict[str, dict[str, list[dict]]] = {}  # every arm's metric lines, beside the result

    def run_and_record(name: str, pools: OnePool) -> None:
        """Run arm `name` and record it; a failed arm is recorded with its error, so the arms
        after it (and TRL) still run on a device call chain that may not come again."""
        arm_config = arms[name]
        try:
            result[name] = run_arm(arm_config, pools.of(arm_config), sft, args)
        except Exception as error:  # recorded; the next arm runs
            result.setdefault("failed", {})[name] = f"{type(error).__name__}: {error}"
            save(result, str(out))
            return
        store = run_store(arm_config)
        train, orch = read_metrics(store, "rl"), read_metrics(store, "orchestrator")
        result.setdefault("timing", {})[name] = loop_timing(train, orch)
        result.setdefault("health", {})[name] = learning_health(train, orch)
        if "reference" in result:
            result.setdefault("headlines", {})[name] = headline(result[name], result["reference"])
        lines[name] = {"rl": train, "orchestrator": orch}
        save(result, str(out))
        save(lines, str(out.with_name(f"{out.stem}-metrics.json")))

    with OnePool() as pools:
        # The recipe's arm, then TRL, then the other arms: the headline comes first.
        run_and_record(PRIMEFLOW, pools)
        if not args.skip_reference:
            trl_clock, trl_kept, result.setdefault("health", {})["reference"] = run_reference(
                args, config, sft, workdir
            )
            trl_store = ObjectStore(f"file://{workdir}/reference")
            policies: dict[int, str | Path] = {0: sft, **trl_kept}
            result["reference"] = evaluate_kept(
                config, pools.of(config), trl_store, "held-out", policies, trl_clock
            )
            if PRIMEFLOW in result:
                result["headline"] = headline(result[PRIMEFLOW], result["reference"])
                result["headlines"] = {PRIMEFLOW: result["headline"]}
            save(result, str(out))
        for name in arms:
            if name != PRIMEFLOW:
                run_and_record(name, pools)
    save(result, str(out))
    if "reference" in result:
        figure_png(result, out.with_suffix(".png"))
    print(json.dumps({key: result.get(key) for key in ("headlines", "timing", "health", "failed")}))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
