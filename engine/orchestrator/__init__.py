"""The orchestrator: rollouts → scored groups → advantages, filters, async bound → shards; eval."""

from engine.orchestrator.main import EvalOutcome, evaluate_policy, run_eval, run_orchestrator

__all__ = ["EvalOutcome", "evaluate_policy", "run_eval", "run_orchestrator"]
