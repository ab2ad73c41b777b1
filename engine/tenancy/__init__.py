"""Shared pools for LoRA tenants: one pool pair (`primeflow pools up`) trains and serves the
adapters of many runs, each a tenant (docs/tenants.md).

    files           the request, lease and state files through which tenants and the pools
                    talk, the pool record, and why a run may not join (`refusal`)
    supervisor      the pool pair behind `primeflow pools up`: starts, restarts, stops it
    shared_trainer  the torchrun side: one base model, one adapter and `Trainer` per tenant
    attached        a tenant's view of the shared inference servers (its adapters only)
    stage           a tenant's RL stage: the `StageTrainer` that `engine.stages.run_rl` drives

Every part lives here, the shared trainer and the tenant's view of the servers included,
because the files module is what all of them read: `engine.trainer` and `engine.inference`
importing it while the supervisor imports them would be an import cycle between engine's
packages. The two keep their pools' rule on their own (pyproject.toml's import-linter
contracts): the shared trainer never imports `engine.inference`, the attached view never
imports `engine.trainer`.
"""
