"""Checks of a resolved config against this machine, made before any pool starts.

The schema (`engine.config`) catches what is wrong with the values themselves; what needs the
machine — a model folder that is not there, an environment package that is not installed, a
local data file that is missing — used to surface minutes later, after vLLM had started and a
retry had run, under several tracebacks. `preflight` finds them in well under a second and
returns each as one line naming the key; the CLI refuses the config with exit 2, a flow
before its first task.

Each environment is then loaded as the orchestrator will load it (its `load_environment` with
the configured args, or its taskset), so a raising one is named here, with the exception's type,
rather than after the servers started. It costs the verifiers import (~3 s once per process,
which the orchestrator, in the same flow process, would pay anyway) and milliseconds per built-in.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from engine.config import PrimeflowConfig
from engine.config.model import looks_like_path
from engine.config.orchestrator import EnvConfig
from engine.config.sft import DATA_SUFFIXES
from engine.envs.loader import load_environment, module_candidates, not_found


def _model_problem(name: str) -> str | None:
    """A local model folder that is not there (built-in and hub names are not paths)."""
    if looks_like_path(name):
        folder = Path(name).expanduser()
        if not (folder / "config.json").is_file():
            reason = "does not exist" if not folder.exists() else "has no config.json"
            return f"model.name: model path {name} {reason}"
    return None


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _load_problem(env: EnvConfig) -> str | None:
    """The first line of what loading `env` raised, with the exception's type; None if it loads."""
    try:
        load_environment(env)
    except Exception as exc:
        lines = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return None


def _environment_problems(config: PrimeflowConfig) -> list[str]:
    named = [
        *((f"orchestrator.envs[{i}]", env) for i, env in enumerate(config.orchestrator.envs)),
        *((f"eval.envs[{i}]", env) for i, env in enumerate(config.eval.envs)),
    ]
    problems = []
    for key, env in named:
        if not any(_installed(module) for module in module_candidates(env.id)):
            problems.append(f"{key}.id: {not_found(env.id)}")
        elif (failure := _load_problem(env)) is not None:
            problems.append(f"{key}: environment {env.id!r} failed to load: {failure}")
    return problems


def _sft_data_problem(config: PrimeflowConfig) -> str | None:
    data = config.sft.data
    if data.path is not None:
        is_local = "://" not in data.path and data.path.lower().endswith(DATA_SUFFIXES)
        if is_local and not Path(data.path).expanduser().is_file():
            return f"sft.data.path = {data.path}: no such file"
        return None
    if data.env is not None and ":" not in data.env:
        module = f"engine.envs.{data.env.replace('-', '_')}"
        if not _installed(module):
            return (
                f"sft.data.env = {data.env!r} is not a built-in environment; name a source "
                "as 'package.module:function'"
            )
    return None


def preflight(config: PrimeflowConfig, *, sft: bool = True) -> list[str]:
    """What is wrong with `config` on this machine, one line each (empty: nothing found).
    `sft`: whether the command runs the SFT stage (its data is checked only then)."""
    problems = [p for p in [_model_problem(config.model.name)] if p]
    problems += _environment_problems(config)
    if sft:
        problems += [p for p in [_sft_data_problem(config)] if p]
    return problems
