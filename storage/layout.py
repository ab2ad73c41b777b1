"""Where everything of a run lives, relative to its run root (docs/storage.md, "Run layout").

Every pool derives paths from these functions and nothing else, so a trainer, an inference
server and a notebook opened months later all agree on where step 42's shards are.
"""

from __future__ import annotations

import re
from typing import Literal

from storage.backends import split_uri

#: The stages that train and commit checkpoints.
Stage = Literal["sft", "rl"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_NAME_CHAR = re.compile(r"[A-Za-z0-9._-]")
_MAX_NAME = 128
_STEP_PREFIX = "step_"
_STEP_DIGITS = 6
_STEP_NAME = re.compile(rf"{_STEP_PREFIX}(\d{{{_STEP_DIGITS},}})")


def _check_name(name: str, kind: str) -> str:
    """`name` if it can name one folder on every backend, else a `ValueError` saying why."""
    if not isinstance(name, str):
        raise TypeError(f"{kind} must be a str, got {type(name).__name__}")
    if not name:
        raise ValueError(f"{kind} must not be empty")
    if len(name) > _MAX_NAME:
        raise ValueError(f"{kind} {name!r} has {len(name)} characters; at most {_MAX_NAME} allowed")
    if any(char.isspace() for char in name):
        raise ValueError(f"{kind} {name!r} must not contain whitespace")
    if "/" in name or "\\" in name:
        raise ValueError(f"{kind} {name!r} must not contain '/' or '\\'")
    if ".." in name:
        raise ValueError(f"{kind} {name!r} must not contain '..'")
    if not _NAME.fullmatch(name):
        if not _NAME_CHAR.fullmatch(name[0]) or name[0] in "._-":
            raise ValueError(f"{kind} {name!r} must start with a letter or a digit")
        bad = "".join(sorted({char for char in name if not _NAME_CHAR.fullmatch(char)}))
        raise ValueError(f"{kind} {name!r} contains {bad!r}; use letters, digits, '.', '_', '-'")
    return name


def validate_folder_name(name: str, kind: str) -> str:
    """Return `name` if it can name one folder on every backend, else raise `ValueError`
    naming it as `kind`."""
    return _check_name(name, kind)


def validate_run_name(name: str) -> str:
    """Return `name` if it can name a run folder on every backend, else raise `ValueError`."""
    return _check_name(name, "run name")


def run_uri(storage_uri: str, run_name: str) -> str:
    """The run root URI: `<storage_uri>/<run_name>`."""
    split_uri(storage_uri)
    return f"{storage_uri.rstrip('/')}/{validate_run_name(run_name)}"


def delta_file_name(rank: int, world: int) -> str:
    """The delta file trainer rank `rank` of `world` writes into a policy version's folder."""
    return f"delta-{rank:05d}-of-{world:05d}.safetensors"


def is_delta_file(name: str) -> bool:
    return name.startswith("delta-") and name.endswith(".safetensors")


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return step


class RunLayout:
    """Relative paths inside a run root; use them with a store rooted at the run."""

    MANIFEST = "manifest.json"
    METRICS = "metrics.jsonl"
    #: One metric line per stage and step: `metrics/<stage>/step_N.jsonl`.
    METRICS_DIR = "metrics"
    LOGS = "logs"
    ROLLOUTS = "rollouts"
    CHECKPOINTS = "checkpoints"
    POLICIES = "policies"
    EVAL = "eval"
    COMMIT_LOG = "commit_log"
    ANNOUNCED = "announced"

    @staticmethod
    def step_name(step: int) -> str:
        """`step_000042`: zero-padded to 6 digits so names sort in step order up to 999999."""
        return f"{_STEP_PREFIX}{_check_step(step):0{_STEP_DIGITS}d}"

    @staticmethod
    def parse_step(name: str) -> int | None:
        """The step of a `step_NNNNNN` folder name, or None for any other name."""
        match = _STEP_NAME.fullmatch(name)
        if match is None:
            return None
        digits = match.group(1)
        # Wider names are only written once 6 digits no longer fit; anything else is foreign.
        if len(digits) > _STEP_DIGITS and digits.startswith("0"):
            return None
        return int(digits)

    @staticmethod
    def stage_dir(stage: Stage) -> str:
        """Below the run root, the folder a stage's checkpoints (and its own rollouts or data)
        live in: `sft` for SFT, the root itself ("") for RL."""
        return "sft" if stage == "sft" else ""

    @classmethod
    def stage_checkpoints(cls, stage: Stage) -> str:
        """A stage's checkpoints below the run root: `sft/checkpoints` or `checkpoints`."""
        return "/".join(part for part in (cls.stage_dir(stage), cls.CHECKPOINTS) if part)

    @classmethod
    def rollouts_dir(cls, step: int) -> str:
        return f"{cls.ROLLOUTS}/{cls.step_name(step)}"

    @classmethod
    def checkpoint_dir(cls, step: int) -> str:
        return f"{cls.CHECKPOINTS}/{cls.step_name(step)}"

    @staticmethod
    def _beside(parent: str, log: str) -> str:
        head, _, tail = parent.rpartition("/")
        return "/".join(part for part in (head, log, tail) if part)

    @classmethod
    def commit_log_dir(cls, parent: str) -> str:
        """`commit_log/checkpoints` beside `checkpoints` (`sft/commit_log/checkpoints` for
        `sft/checkpoints`): one entry per committed step of `parent`, which retention never
        deletes, so a watcher polling `parent` learns of every commit, even of a step pruned
        before it looked. Kept out of `parent`, which holds step folders only."""
        return cls._beside(parent, cls.COMMIT_LOG)

    @classmethod
    def commit_log_entry(cls, parent: str, step: int) -> str:
        return f"{cls.commit_log_dir(parent)}/{cls.step_name(step)}.json"

    @classmethod
    def announced_dir(cls, parent: str) -> str:
        """`announced/checkpoints` beside `checkpoints`: one entry per committed step of
        `parent` that watchers were told of (the control plane's checkpoint event), so that a
        step committed while nobody watched (the flow process was killed, its trainer went on)
        is told of when the run is next watched, and no step twice."""
        return cls._beside(parent, cls.ANNOUNCED)

    @classmethod
    def announced_entry(cls, parent: str, step: int) -> str:
        return f"{cls.announced_dir(parent)}/{cls.step_name(step)}.json"

    @classmethod
    def metrics_dir(cls, stage: str) -> str:
        return f"{cls.METRICS_DIR}/{_check_name(stage, 'metrics stage')}"

    @classmethod
    def metrics_path(cls, stage: str, step: int) -> str:
        return f"{cls.metrics_dir(stage)}/{cls.step_name(step)}.jsonl"

    @classmethod
    def policy_dir(cls, step: int) -> str:
        """Policy version `step`: the weights a server loads, published every RL step."""
        return f"{cls.POLICIES}/{cls.step_name(step)}"

    @classmethod
    def eval_parent(cls, name: str) -> str:
        return f"{cls.EVAL}/{_check_name(name, 'eval name')}"

    @classmethod
    def eval_dir(cls, name: str, step: int) -> str:
        return f"{cls.eval_parent(name)}/{cls.step_name(step)}"
