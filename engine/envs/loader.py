"""Environments by id: the built-ins, classic verifiers packages, and verifiers v1 tasksets.

An id names a built-in (`reverse-text`, `alphabet-sort`, `arithmetic`, and the agentic
`tool-math`, `corpus-search`, `wordle`) or an installed module
(`my-env` imports `my_env`; dotted module paths work too). A module with `load_environment` is a
classic verifiers environment, called with the configured args; a module exporting a v1
`Taskset` (also looked up among verifiers' own `verifiers.v1.tasksets`) is a taskset whose
config takes the args. Nothing is downloaded or installed here: a missing package is an error
that names it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from engine.config.orchestrator import EnvConfig
from engine.envs.base import Environment

BUILTIN_ENVS: dict[str, str] = {
    "reverse-text": "engine.envs.reverse_text",
    "alphabet-sort": "engine.envs.alphabet_sort",
    "arithmetic": "engine.envs.arithmetic",
    "tool-math": "engine.envs.tool_math",
    "corpus-search": "engine.envs.corpus_search",
    "wordle": "engine.envs.wordle",
}
_V1_TASKSETS = "verifiers.v1.tasksets"


def module_name(env_id: str) -> str:
    """The module an id names: built-ins by table, else dashes to underscores (`a-b` → `a_b`)."""
    return BUILTIN_ENVS.get(env_id) or env_id.split("@", 1)[0].replace("-", "_")


def module_candidates(env_id: str) -> list[str]:
    """The modules `env_id` may name, in the order they are tried."""
    name = module_name(env_id)
    return [name] if "." in name else [name, f"{_V1_TASKSETS}.{name}"]


def not_found(env_id: str) -> ValueError:
    return ValueError(
        f"environment {env_id!r} not found: no module {module_name(env_id)!r} is installed. Use "
        f"a built-in ({', '.join(BUILTIN_ENVS)}) or install the environment package into this venv"
    )


def import_environment(env_id: str) -> ModuleType:
    """The module environment `env_id` names; `ValueError` naming it when none is installed."""
    for candidate in module_candidates(env_id):
        try:
            return importlib.import_module(candidate)
        except ModuleNotFoundError as exc:
            if exc.name != candidate and not candidate.startswith(f"{exc.name}."):
                raise  # the module exists but one of its own imports is missing
    raise not_found(env_id)


def load_environment(config: EnvConfig) -> Environment:
    """The configured environment, wrapped so callers never see verifiers types."""
    module = import_environment(config.id)
    name = config.name or config.id
    if hasattr(module, "load_environment"):
        import datasets

        from engine.envs.classic import ClassicEnvironment, no_signal_handlers

        # verifiers formats datasets with `map`, whose progress bars would fill the stderr of
        # a command that has one line to say (a preflight refusal) and every run's log.
        datasets.disable_progress_bars()
        with no_signal_handlers():
            env = module.load_environment(**config.args)
        return ClassicEnvironment(env, name=name)
    import verifiers.v1 as vf1

    from engine.envs.taskset import TasksetEnvironment, exported

    if exported(module, vf1.Taskset):
        return TasksetEnvironment.load(module, config.id, dict(config.args), name=name)
    raise ValueError(
        f"environment {config.id!r} ({module.__name__}) has no `load_environment` and exports "
        "no verifiers v1 Taskset"
    )
