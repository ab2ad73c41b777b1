"""What the stages and the pipeline return: small, typed, JSON-serialisable records.

They are what a Prefect task or flow returns (persisted as JSON beside the runs: Prefect's
serializer writes a dataclass's fields and reads them back into the class) and what the
terminal summary and the UI's summary artifact read, by attribute rather than by string key.
Nothing large goes in: URIs, steps, seconds, headline numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from storage.layout import Stage


@dataclass(frozen=True)
class StageResult:
    """What a finished stage left: its last step, its newest checkpoint, its time."""

    stage: Stage
    last_step: int
    checkpoint_step: int | None
    checkpoint: str | None
    seconds: float


@dataclass(frozen=True)
class EvalResult:
    """One committed evaluation: where it lives, the policy step it took, its headline numbers
    (`avg@k`, `pass@k`, `greedy/avg@1`, ... from its `summary.json`)."""

    name: str
    step: int
    uri: str
    samples: int
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_summary(
        cls, name: str, uri: str, summary: Mapping[str, Any], seconds: float
    ) -> EvalResult:
        """From an evaluation's `summary.json` document (`storage.evals`)."""
        envs = summary.get("envs", {})
        return cls(
            name=name,
            step=int(summary["step"]),
            uri=uri,
            samples=sum(int(env.get("samples", 0)) for env in envs.values()),
            seconds=seconds,
            metrics={
                key: float(value)
                for key, value in summary.items()
                if isinstance(value, int | float) and not isinstance(value, bool) and key != "step"
            },
        )


#: Below this share of groups with an advantage, the summary says RL had little to learn from.
LOW_SIGNAL = 0.1


@dataclass(frozen=True)
class RunReport:
    """Where `engine.report.write_run_report` put the run's report, the sampled reward's
    standard error per evaluation (the ± the summaries print), and the paired gain of each
    policy over the one before it: {"rl-sft": {"sampled": {"examples", "mean", "stderr"},
    "greedy": {...}}}. A gain is measured on the same prompts, so its standard error is the
    honest noise of an improvement, far below what two separate ± would suggest. `signal` is
    how much RL had to learn from (`engine.report.run_report.rl_signal`; empty without RL)."""

    plot: str
    samples_md: str
    report: str
    stderr: dict[str, float] = field(default_factory=dict)
    gains: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    signal: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_report(cls, report: Mapping[str, Any]) -> RunReport:
        stderr = {
            name: float(stats["sampled"]["stderr"])
            for name, stats in report.get("evals", {}).items()
            if isinstance(stats.get("sampled", {}).get("stderr"), int | float)
        }
        gains = {
            pair: {mode: dict(diff) for mode, diff in modes.items() if diff is not None}
            for pair, modes in report.get("differences", {}).items()
        }
        return cls(
            plot=report["plot"], samples_md=report["samples_md"], report=report["report"],
            stderr=stderr, gains={pair: modes for pair, modes in gains.items() if modes},
            signal=dict(report.get("rl_signal") or {}),
        )  # fmt: skip

    def gain_lines(self) -> list[str]:
        """'rl − sft: +0.041 ± 0.013 sampled, +0.035 ± 0.010 greedy (paired, 100 prompts)'."""
        lines = []
        for pair, modes in self.gains.items():
            after, before = pair.split("-", 1)
            parts = [f"{d['mean']:+.3f} ± {d['stderr']:.3f} {mode}" for mode, d in modes.items()]
            prompts = max(int(d["examples"]) for d in modes.values())
            lines.append(f"{after} − {before}: {', '.join(parts)} (paired, {prompts} prompts)")
        return lines

    def signal_line(self) -> str | None:
        """'12 % of RL's groups had an advantage; 3 of 80 steps had none', and where almost
        none had, why RL could not move the reward (a table of flat rewards does not say)."""
        if not self.signal:
            return None
        share, steps = self.signal["groups_with_advantage"], int(self.signal["steps"])
        line = (
            f"{share:.0%} of RL's groups had an advantage; "
            f"{int(self.signal['steps_without'])} of {steps} steps had none"
        )
        if share < LOW_SIGNAL:
            line += (
                ": each prompt's samples scored alike, so RL had next to nothing to learn "
                "from (docs/training.md)"
            )
        return line


@dataclass(frozen=True)
class PipelineResult:
    """The `post-train` flow's result: every stage and evaluation it ran, and the report."""

    run: str
    root: str
    eval_base: EvalResult | None = None
    sft: StageResult | None = None
    eval_sft: EvalResult | None = None
    rl: StageResult | None = None
    eval_rl: EvalResult | None = None
    report: RunReport | None = None

    def evals(self) -> list[tuple[str, EvalResult]]:
        """(policy, evaluation) in the order the pipeline ran them: base, sft, rl."""
        pairs = (("base", self.eval_base), ("sft", self.eval_sft), ("rl", self.eval_rl))
        return [(policy, result) for policy, result in pairs if result is not None]

    def stages(self) -> list[StageResult]:
        return [stage for stage in (self.sft, self.rl) if stage is not None]
