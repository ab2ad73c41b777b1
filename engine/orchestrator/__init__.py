"""The orchestrator: rollouts → scored groups → advantages, filters, async bound → shards; eval.

Entry points live in `engine.orchestrator.main` (`run_orchestrator`,
`evaluate_policy`); this package file imports nothing so the pure parts load fast.
"""
