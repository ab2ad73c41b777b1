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
Then a sample of each one's prompts is rendered with the policy's chat template (system prompt
and tools included, `engine.envs.prompt_fit`): an environment whose prompts leave no room for
its `max_tokens` within `seq_len` is refused with the `seq_len` it needs, where it used to be
drawn and skipped forever. An RL run on shared pools (`pools.name`) is refused when those pools
are not running or train another base model or other adapters.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from engine.config import PrimeflowConfig
from engine.config.model import looks_like_path
from engine.config.orchestrator import EnvConfig
from engine.config.sft import DATA_SUFFIXES
from engine.envs import ChatTokenizer, Environment, Split
from engine.envs.loader import load_environment, module_candidates, not_found
from engine.envs.prompt_fit import longest_prompt
from engine.tenancy.files import NoSuchPoolError, PoolRecord, refusal

#: The stages a command may run.
STAGES = ("sft", "rl", "eval")


def _model_problem(name: str) -> str | None:
    """A local model folder that is not there (built-in and hub names are not paths)."""
    if looks_like_path(name):
        folder = Path(name).expanduser()
        if not (folder / "config.json").is_file():
            reason = "does not exist" if not folder.exists() else "has no config.json"
            return f"model.name: model path {name} {reason}"
    return None


def _tenant_problem(config: PrimeflowConfig, pools: str) -> str | None:
    """RL on shared pools that are not running, or that train another base or other adapters:
    the shared trainer would refuse the tenant anyway, after its flow run had started."""
    try:
        record = PoolRecord.read(pools)
    except NoSuchPoolError as exc:
        return f"pools.name: {exc}"
    refused = refusal(record, config)
    return f"pools.name: {refused}" if refused else None


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _load(env: EnvConfig) -> Environment | str:
    """The loaded environment, or the first line of what loading it raised, with its type."""
    try:
        return load_environment(env)
    except Exception as exc:
        lines = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _chat_tokenizer(config: PrimeflowConfig, *, local_only: bool) -> ChatTokenizer | None:
    """The policy's tokenizer, when it loads here (else the fit of prompts is not checked).
    `local_only`: a hub model only from the local cache, never a lookup (on a machine that
    cannot reach the hub, the lookup's retries took 46 s of a dry run). Imported here: torch and
    transformers cost every `primeflow` command ~2.5 s, and only the config commands need them."""
    from engine.models.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(config.orchestrator.model, config.model, local_only=local_only)
        return ChatTokenizer(tokenizer)
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class _Use:
    """One configured environment: where in the config, and how it samples."""

    section: str
    key: str
    env: EnvConfig
    split: Split
    sampling: str
    max_tokens: int


def _uses(config: PrimeflowConfig) -> list[_Use]:
    orchestrator, evaluation = config.orchestrator, config.eval
    uses = []
    for where, envs, split, default in (
        ("orchestrator", orchestrator.envs, "train", orchestrator.sampling),
        ("eval", evaluation.envs, "eval", evaluation.sampling),
    ):
        for i, env in enumerate(envs):
            key = f"{where}.envs[{i}]"
            sampling = f"{key}.sampling" if env.sampling else f"{where}.sampling"
            max_tokens = (env.sampling or default).max_tokens
            uses.append(_Use(where, key, env, split, sampling, max_tokens))  # type: ignore[arg-type]
    return uses


def _fit_problem(use: _Use, env: Environment, tokenizer: ChatTokenizer, seq_len: int) -> str | None:
    """An environment whose prompts leave no room for `max_tokens` in `seq_len`."""
    longest = longest_prompt(env, tokenizer, use.split)
    if longest is None or longest.tokens + use.max_tokens <= seq_len:
        return None
    return (
        f"{use.key}: environment {env.name!r}: its {use.split} prompts take up to "
        f"{longest.tokens} tokens (example {longest.example_id}, chat template, system prompt "
        f"and tools included), which leaves no room for {use.sampling}.max_tokens = "
        f"{use.max_tokens} in "
        f"seq_len = {seq_len}: set seq_len to at least {longest.tokens + use.max_tokens}"
    )


def _environment_problems(
    config: PrimeflowConfig, samples: set[str], *, local_only: bool
) -> list[str]:
    """Environments not installed or failing to load; those of the sections in `samples`
    ("orchestrator", "eval") whose prompts leave no room to sample."""
    problems = []
    tokenizer = _chat_tokenizer(config, local_only=local_only) if samples else None
    seq_len = config.orchestrator.seq_len
    for use in _uses(config):
        if not any(_installed(module) for module in module_candidates(use.env.id)):
            problems.append(f"{use.key}.id: {not_found(use.env.id)}")
            continue
        loaded = _load(use.env)
        if isinstance(loaded, str):
            problems.append(f"{use.key}: environment {use.env.id!r} failed to load: {loaded}")
        elif tokenizer is not None and seq_len is not None and use.section in samples:
            problems += [p for p in [_fit_problem(use, loaded, tokenizer, seq_len)] if p]
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


def preflight(
    config: PrimeflowConfig, stages: Collection[str] = STAGES, *, dry_run: bool = False
) -> list[str]:
    """What is wrong with `config` on this machine, one line each (empty: nothing found).
    `stages`: what the command runs, of `STAGES`: SFT's data is checked only when it runs SFT
    (and `sft.enabled`), the training environments' prompts must fit when it runs RL, the
    evaluation environments' when it evaluates (RL does with `eval.interval`). An RL tenant's
    shared pools must be running and train its base and adapter shape. A `dry_run` starts
    nothing and fetches nothing: it leaves the shared pools out, and checks the fit of prompts
    only with a tokenizer that is on this machine already."""
    problems = [p for p in [_model_problem(config.model.name)] if p]
    samples = set()
    if "rl" in stages:
        samples.add("orchestrator")
    if "eval" in stages or ("rl" in stages and config.eval.interval is not None):
        samples.add("eval")
    problems += _environment_problems(config, samples, local_only=dry_run)
    if not dry_run and "rl" in stages and config.pools.name is not None:
        problems += [p for p in [_tenant_problem(config, config.pools.name)] if p]
    if "sft" in stages and config.sft.enabled:
        problems += [p for p in [_sft_data_problem(config)] if p]
    return problems
