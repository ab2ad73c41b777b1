"""A run's report: reward/loss plot, eval noise and before/after sample tables (no Prefect)."""

from engine.report.run_report import write_run_report

__all__ = ["write_run_report"]
