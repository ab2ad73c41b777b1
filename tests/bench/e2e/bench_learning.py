"""Does RL make the policy better? Arms of RL from one SFT checkpoint, side by side, each scored
on held-out greedy and sampled reward as it trains.

One SFT run (or `--sft-checkpoint`), then every `--arm NAME=FLAGS` runs the RL stage from it in
a process of its own (its own vLLM server and trainer, `--parallel` at a time: on one GPU both
pools of every arm share it), with `eval.interval` set, so each arm's `eval-online` lines hold
the held-out reward of its policy at version 0 (the SFT result) and every `--eval-interval`
versions after. What the arms committed is collected into one JSON (rewritten every half
minute while they run, so a run cut short still reports) and a figure of held-out reward
against step for every arm; the table printed last has, per arm, the held-out greedy and
sampled reward at the start, at the end and at their best, the training reward, entropy, the
share of groups without advantage, clipping and the step time. Beside the JSON, each arm's
health step by step and a few of its training rollouts (`OUT-NAME-steps.txt`, `step_health`).

    python -m tests.bench.e2e.bench_learning --config configs/reverse_text/gpu.toml \
        --sft-steps 100 --steps 300 --eval-interval 25 --parallel 6 \
        --arm shipped= --arm 'lr1e-4=--trainer.optim.lr 1e-4' --workdir /tmp/grid --out grid.json
    python -m tests.bench.e2e.bench_learning --collect --workdir /tmp/grid --out grid.json
    # the instrument on a CPU machine (the demo's config, a few steps):
    python -m tests.bench.e2e.bench_learning --sft-steps 20 --steps 4 --eval-interval 2 \
        --eval-examples 8 --arm a= --arm 'b=--trainer.optim.lr 1e-3'

Flags after `--` go to every arm (and the SFT run).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from engine.config import PrimeflowConfig, load_config, with_overrides
from engine.inference.pool import InferencePool
from engine.orchestrator.main import evaluate_policy
from engine.orchestrator.online_eval import ONLINE_EVAL_STAGE
from engine.run import open_run, run_store
from engine.stages import run_rl
from storage.commit import latest_committed_step
from storage.evals import committed_summary
from storage.layout import RunLayout
from storage.metrics import read_metrics
from tests.bench.e2e.bench_async import save, train_sft
from tests.bench.e2e.bench_tenants import mps_daemon
from tests.bench.e2e.step_health import health_text

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "configs/reverse_text/pipeline.toml"
#: Seconds between two collections while the arms run.
COLLECT_S = 30.0
#: Seconds between two arm starts (their servers load at once otherwise).
STAGGER_S = 5.0
#: The evaluation of each arm's last policy (`eval/rl-final/`).
FINAL = "rl-final"


#: An arm: its name and its config flags.
Arm = tuple[str, list[str]]


def parse_arm(text: str) -> Arm:
    """`NAME=FLAGS` → (name, flags)."""
    name, sep, flags = text.partition("=")
    if not sep or not name or not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise SystemExit(f"--arm {text!r}: give NAME=FLAGS, NAME of letters, digits, . - _")
    return name, shlex.split(flags)


def select_arms(specs: list[Arm], only: str | None) -> list[Arm]:
    """The arms named in `only` (comma-separated), in the file's order: a grid longer than one
    device session runs in parts, each with its baseline arm named again."""
    if not only:
        return specs
    wanted = [name.strip() for name in only.split(",") if name.strip()]
    known = [name for name, _ in specs]
    if unknown := [name for name in wanted if name not in known]:
        raise SystemExit(f"--only {','.join(unknown)}: no such arm; the arms are {','.join(known)}")
    return [(name, flags) for name, flags in specs if name in wanted]


def grid_args(args: argparse.Namespace, workdir: Path) -> list[str]:
    """The flags every arm (and the SFT run) shares."""
    files = [item for path in args.config for item in ("@", str(path))]
    return [
        *files,
        "--storage.uri", f"file://{workdir}",
        "--max-steps", str(args.steps),
        "--sft.max-steps", str(args.sft_steps),
        "--eval.interval", str(args.eval_interval),
        "--eval.interval-examples", str(args.eval_examples),
        # One resume checkpoint, at the end: a grid's disk is its arms' checkpoints otherwise.
        "--trainer.checkpoint.interval", str(args.steps),
        "--trainer.checkpoint.keep-last", "1",
        *args.overrides,
    ]  # fmt: skip


def arm_config(shared: Sequence[str], name: str, flags: Sequence[str], sft: str) -> PrimeflowConfig:
    config = load_config([*shared, "--run.name", name, *flags])
    return with_overrides(config, {"trainer.init_checkpoint": sft})


def run_arm(config: PrimeflowConfig) -> None:
    """One arm in this process: its vLLM server, then the RL stage from the SFT checkpoint, as
    the `rl` flow runs it (`engine.stages.run_rl`: a trainer that dies fails the arm at once)."""
    sft = config.trainer.init_checkpoint
    assert sft is not None
    run = open_run(config, command=["bench_learning", config.run.name])
    with InferencePool.for_run(config, run.logs) as pool:
        pool.reload(sft, version=0)
        result = run_rl(config, run, pool)
        assert result.checkpoint_step is not None
        # The last version is published after the last batch: the orchestrator never serves it.
        evaluate_policy(
            config, run.store, pool, name=FINAL, stage="rl", step=result.checkpoint_step
        )


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _series(lines: Sequence[dict], key: str) -> list[float]:
    return [line[key] for line in lines if isinstance(line.get(key), int | float)]


def arm_result(config: PrimeflowConfig) -> dict[str, Any]:
    """What one arm has committed so far, and its headline numbers."""
    store = run_store(config)
    evals = read_metrics(store, ONLINE_EVAL_STAGE)
    orch, train = read_metrics(store, "orchestrator"), read_metrics(store, "rl")
    sampled_key = next((k for line in evals for k in line if k.startswith("eval/avg@")), None)
    curve = [
        {
            "step": line["step"],
            "time": line["time"],
            "greedy": line.get("eval/greedy/avg@1"),
            "sampled": line.get(sampled_key) if sampled_key else None,
        }
        for line in evals
    ]
    final = latest_committed_step(store, RunLayout.eval_parent(FINAL))
    done = committed_summary(store, FINAL, final) if final is not None else None
    if done is not None:
        summary = done[1]
        curve.append(
            {
                "step": final,
                "time": read_metrics(store, f"eval-{FINAL}")[-1]["time"],
                "greedy": summary.get("greedy/avg@1"),
                "sampled": summary.get(f"avg@{summary['k']}"),
            }
        )
    greedy = [point["greedy"] for point in curve if point["greedy"] is not None]
    sampled = [point["sampled"] for point in curve if point["sampled"] is not None]
    return {
        "steps": len(train),
        "curve": curve,
        "greedy_first": greedy[0] if greedy else None,
        "greedy_last": greedy[-1] if greedy else None,
        "greedy_best": max(greedy, default=None),
        "sampled_first": sampled[0] if sampled else None,
        "sampled_last": sampled[-1] if sampled else None,
        **learning_health(train, orch),
        **loop_timing(train, orch),
    }


def learning_health(train: Sequence[dict], orch: Sequence[dict]) -> dict[str, float | None]:
    """Whether the updates were sound, means over the run (and its first steps, where a bad
    start shows): training reward and entropy, the groups that taught nothing, clipped or
    capped tokens, the trainer-inference mismatch, importance weights and gradient norms."""
    rewards = _series(orch, "reward/mean")
    entropy = _series(train, "entropy")
    grad_norms = _series(train, "grad_norm")
    clip = [
        sum(line.get(key, 0.0) for key in ("capped_fraction", "clip_low_fraction",
                                           "clip_high_fraction", "masked_fraction"))
        for line in train
    ]  # fmt: skip
    return {
        "train_reward_first10": _mean(rewards[:10]),
        "train_reward_last10": _mean(rewards[-10:]),
        "entropy_first10": _mean(entropy[:10]),
        "entropy_last10": _mean(entropy[-10:]),
        "zero_group_fraction": _mean(_series(orch, "advantage/zero_group_fraction")),
        "nonzero_token_fraction": _mean(_series(orch, "advantage/nonzero_token_fraction")),
        "clip_fraction": _mean(clip),
        "mismatch_kl": _mean(_series(train, "mismatch_kl")),
        # Numerics alone, and numerics plus recent updates' movement (samples drawn before them)
        "mismatch_kl_fresh": _mean(_series(train, "mismatch_kl_fresh")),
        "mismatch_kl_stale": _mean(_series(train, "mismatch_kl_stale")),
        "ratio": _mean(_series(train, "ratio")),
        "grad_norm": _mean(grad_norms),
        "grad_norm_first25": _mean(grad_norms[:25]),
        "stale_rollouts": sum(
            _series(orch, "count/stale/off_policy") + _series(orch, "count/stale/async_bound")
        ),
        # How many versions behind the trained one its oldest rollout was (0: on-policy).
        "policy_lag_max": _mean(_series(train, "policy_lag_max")),
    }


def loop_timing(train: Sequence[dict], orch: Sequence[dict]) -> dict[str, float | None]:
    """Where a step's time goes, medians over the run: the trainer's own compute, its wait
    for rollouts and its write of a policy version behind the step (and the share of versions
    written full), the pool's sampling rate, its wait for a policy (a mean over the steps: most
    steps wait for none) and its weight swaps (fetch, load, the whole pause: medians over the
    steps a swap ended in, so a step without one does not count as a swap of 0 s, and what
    lay outside those phases)."""
    times = _series(train, "time")
    trained = {line["step"]: line["time"] for line in train if "time" in line}
    sampled = {line["step"]: line["time"] for line in orch if "time" in line}
    swap_phases = sorted({k for line in orch for k in line if k.startswith("time/reload_")})
    waits = _series(orch, "time/policy_wait_s")
    full = _series(train, "policy_full")
    # A swap's time outside its measured phases (the orchestrator's hand-off to the reload's
    # thread and back, the servers' control clients): 0.16 s of 0.39 s on the H100.
    outside = [
        line["time/reload_s"]
        - sum(line.get(f"time/reload_{phase}_s", 0.0) for phase in ("fetch", "stage", "paused"))
        for line in orch
        if line.get("time/reload_s", 0.0) > 0
    ]
    return {
        "step_s_median": statistics.median(b - a for a, b in itertools.pairwise(times))
        if len(times) > 2
        else None,
        "step_s_mean": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
        "train_s_median": _median(_series(train, "step_seconds")),
        "wait_s_median": _median(_series(train, "wait_seconds")),
        "publish_write_s_median": _median(_series(train, "publish_write_seconds")),
        # The loop's two halves, from each side's metric line (written as it ends its part):
        # batch n committed -> trained and snapshotted (trainer poll, read, step, snapshot),
        # then -> batch n + 1 committed (version write, pool poll, swap, sampling, commit).
        # On-policy they add up to the step; async they overlap.
        "rollouts_to_trained_s_median": _median(
            [trained[n] - sampled[n] for n in trained if n in sampled]
        ),
        "trained_to_rollouts_s_median": _median(
            [sampled[n + 1] - trained[n] for n in trained if n + 1 in sampled]
        ),
        "sampled_tokens_per_s": _median(_series(orch, "throughput/tokens_per_s")),
        "policy_wait_s_mean": statistics.fmean(waits) if waits else None,
        "versions_full_fraction": statistics.fmean(full) if full else None,
        "swaps": len([v for v in _series(orch, "time/reload_s") if v > 0]),
        "reload_outside_phases_s_median": _median(outside),
        **{
            f"{k.removeprefix('time/')}_median": _median([v for v in _series(orch, k) if v > 0])
            for k in swap_phases
        },
    }


def collect(arms: dict[str, PrimeflowConfig], meta: dict[str, Any]) -> dict[str, Any]:
    return {**meta, "collected": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "arms": {name: arm_result(config) for name, config in arms.items()}}  # fmt: skip


def figure_png(result: dict[str, Any], path: Path) -> None:
    """Held-out greedy (left) and sampled (right) reward against RL step, one line per arm."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4.5), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, 2, sharey=True)
    for ax, mode in zip(axes, ("greedy", "sampled"), strict=True):
        for name, arm in result["arms"].items():
            points = [(p["step"], p[mode]) for p in arm["curve"] if p[mode] is not None]
            if points:
                ax.plot(*zip(*points, strict=True), ".-", linewidth=1, label=name)
        ax.set_title(f"held-out reward, {mode}", fontsize=10)
        ax.set_xlabel("RL step (policy version)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("reward")
    if axes[1].lines:  # the first collections come before any arm has evaluated
        axes[1].legend(fontsize=7, loc="lower right")
    figure.savefig(path, format="png")


def table(result: dict[str, Any]) -> str:
    keys = ("steps", "greedy_first", "greedy_last", "greedy_best", "sampled_first",
            "sampled_last", "train_reward_first10", "train_reward_last10", "entropy_first10",
            "entropy_last10", "zero_group_fraction", "clip_fraction", "step_s_median",
            "train_s_median", "wait_s_median", "sampled_tokens_per_s")  # fmt: skip
    rows = ["| arm | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name, arm in result["arms"].items():
        cells = [f"{arm[k]:.3f}" if isinstance(arm[k], float) else str(arm[k]) for k in keys]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def report(result: dict[str, Any], out: Path | None) -> None:
    save(result, str(out) if out else None)
    if out:
        figure_png(result, out.with_suffix(".png"))


def launch(
    workdir: Path, name: str, flags: Sequence[str], shared: Sequence[str], sft: str
) -> subprocess.Popen[bytes]:
    """Start arm `name` in a process of its own, its output to `arm-<name>.log`."""
    log = (workdir / f"arm-{name}.log").open("ab")
    command = [sys.executable, "-m", "tests.bench.e2e.bench_learning", "--run-arm", name,
               "--sft-checkpoint", sft, "--", *shared, *flags]  # fmt: skip
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.e2e.bench_learning")
    parser.add_argument("--config", action="append", help="config file(s); default: the demo's")
    parser.add_argument("--arm", action="append", default=[], help="NAME=FLAGS, repeatable")
    parser.add_argument("--arms-file", help="a file of NAME=FLAGS lines (# comments)")
    parser.add_argument("--only", help="NAME,NAME,...: run only these of the arms")
    parser.add_argument("--mps", action="store_true", help="run every arm under NVIDIA MPS")
    parser.add_argument("--sft-checkpoint", help="URI of the SFT checkpoint (else train one)")
    parser.add_argument("--sft-steps", type=int, default=100)
    parser.add_argument("--steps", type=int, default=300, help="RL steps per arm")
    parser.add_argument("--eval-interval", type=int, default=25)
    parser.add_argument("--eval-examples", type=int, default=200)
    parser.add_argument("--parallel", type=int, default=2, help="arms running at once")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=None, help="the JSON (and, beside it, the .png)")
    parser.add_argument("--collect", action="store_true", help="only collect what arms committed")
    parser.add_argument("--run-arm", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="flags for every arm, after --")
    args = parser.parse_args(argv)
    if args.run_arm:  # a child: the flags are the arm's whole config
        config = load_config([*args.overrides, "--run.name", args.run_arm])
        run_arm(with_overrides(config, {"trainer.init_checkpoint": args.sft_checkpoint}))
        return None
    args.config = args.config or [str(DEMO)]
    workdir = Path(args.workdir or f"/tmp/bench-learning-{int(time.time())}").resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    out = Path(args.out).resolve() if args.out else workdir / "learning.json"
    shared = grid_args(args, workdir)
    if args.collect:
        saved = json.loads((workdir / "arms.json").read_text())
        arms = {n: arm_config(saved["shared"], n, f, saved["sft"]) for n, f in saved["arms"]}
        result = collect(arms, saved["meta"])
        report(result, out)
        print(table(result))
        return result
    texts = list(args.arm)
    if args.arms_file:
        lines = Path(args.arms_file).read_text().splitlines()
        texts += [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    specs = select_arms([parse_arm(text) for text in texts], args.only) or [("default", [])]
    probe = "file:///nonexistent"  # every arm's flags are checked before anything runs
    for name, flags in specs:
        arm_config(shared, name, flags, probe)
    with mps_daemon(workdir / "mps") if args.mps else nullcontext():
        return run_grid(args, workdir, out, shared, specs)


def run_grid(
    args: argparse.Namespace,
    workdir: Path,
    out: Path,
    shared: list[str],
    specs: list[Arm],
) -> dict[str, Any]:
    """SFT (unless given), then the arms, `--parallel` at a time, collected as they go."""
    sft = args.sft_checkpoint or train_sft(load_config(shared))
    arms = {name: arm_config(shared, name, flags, sft) for name, flags in specs}
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cores": os.cpu_count(),
        "mps": args.mps,
        "sft_checkpoint": sft,
        "shared_flags": shared,
        "arm_flags": dict(specs),
    }
    (workdir / "arms.json").write_text(
        json.dumps({"shared": shared, "sft": sft, "arms": specs, "meta": meta})
    )
    waiting, running = list(specs), {}
    last = 0.0
    while waiting or running:
        while waiting and len(running) < args.parallel:
            name, flags = waiting.pop(0)
            running[name] = launch(workdir, name, flags, shared, sft)
            print(f"arm {name} started", flush=True)
            time.sleep(STAGGER_S)
        for name, process in list(running.items()):
            if process.poll() is not None:
                print(f"arm {name} ended with status {process.returncode}", flush=True)
                del running[name]
        if time.monotonic() - last > COLLECT_S:
            last = time.monotonic()
            result = collect(arms, meta)
            report(result, out)
            steps = {name: arm["steps"] for name, arm in result["arms"].items()}
            print(f"{time.strftime('%H:%M:%S')} steps per arm: {steps}", flush=True)
        time.sleep(1.0)
    result = collect(arms, meta)
    report(result, out)
    for name, config in arms.items():  # where a collapse starts shows in no mean over the run
        steps = out.with_name(f"{out.stem}-{name}-steps.txt")
        steps.write_text(health_text(run_store(config)))
    print(table(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
