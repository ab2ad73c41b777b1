"""Turn `@ a.toml @ b.toml --section.key value` into a validated `PrimeflowConfig`.

Parsing is prime-pydantic-config's (prime-rl's own config library: `@` files composed left to
right, dotted kebab-case flags, `--flag`/`--no-flag`, lists, JSON for dicts, discriminated unions
by `type`). This module adds what a user needs when it goes wrong: every problem becomes one
line that names the file or the command line that set the offending key.
"""

from __future__ import annotations

import re
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_config import ConfigFileError, cli

from engine.config.root import PrimeflowConfig, shared_copies

COMMAND_LINE = "command line"


class ConfigError(Exception):
    """A config problem, already phrased as the one line the user should read."""


def split_config_args(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """Separate `@ file` references from flags, keeping both in their order."""
    files: list[str] = []
    flags: list[str] = []
    i = 0
    while i < len(args):
        if args[i] == "@":
            if i + 1 >= len(args):
                raise ConfigError("'@' must be followed by a config file path")
            files.append(args[i + 1])
            i += 2
        else:
            flags.append(args[i])
            i += 1
    return files, flags


def read_toml(path: str) -> dict[str, Any]:
    """Load one TOML file, turning a missing or malformed file into a one-line ConfigError."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{path}: config file not found")
    if file.suffix != ".toml":
        raise ConfigError(f"{path}: config files must be TOML (.toml)")
    try:
        return tomllib.loads(file.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None


def _leaf_paths(data: Mapping[str, Any], prefix: str = "") -> list[str]:
    paths: list[str] = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            paths.extend(_leaf_paths(value, f"{path}."))
        else:
            paths.append(path)
    return paths


def _flag_paths(flags: Sequence[str]) -> list[str]:
    """Dotted snake-case keys named by `--a.b-c`, `--a.b-c=v` and `--no-a.b` flags."""
    paths = []
    for flag in flags:
        if not flag.startswith("--") or flag == "--":
            continue
        name = flag[2:].split("=", 1)[0]
        if name.startswith("no-"):
            name = name[3:]
        paths.append(name.replace("-", "_"))
    return paths


def _strip_annotated(annotation: Any) -> Any:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _models_in(annotation: Any) -> tuple[list[type[BaseModel]], bool]:
    """The model classes an annotation can hold, and whether it is a union of several."""
    annotation = _strip_annotated(annotation)
    origin = typing.get_origin(annotation)
    if origin in (list, tuple, set, dict):
        args = typing.get_args(annotation)
        return _models_in(args[-1]) if args else ([], False)
    if origin in (typing.Union, types.UnionType):
        models = [
            m
            for arg in typing.get_args(annotation)
            for m in _models_in(arg)[0]
            if arg is not type(None)
        ]
        return models, len(models) > 1
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation], False
    return [], False


def union_field_paths(cls: type[BaseModel], prefix: str = "") -> set[str]:
    """Dotted paths of fields holding a union of models (pydantic puts the tag in error locs)."""
    paths: set[str] = set()
    for name, info in cls.model_fields.items():
        models, is_union = _models_in(info.annotation)
        if is_union:
            paths.add(f"{prefix}{name}")
        for model in models:
            paths |= union_field_paths(model, f"{prefix}{name}.")
    return paths


def user_path(loc: Sequence[int | str], union_paths: set[str]) -> tuple[str, str | None]:
    """`('trainer', 'loss', 'aipo', 'ratio_cap')` → (`trainer.loss.ratio_cap`, `'aipo'`).

    Pydantic puts the selected variant's tag into the location of errors inside a union; users
    never write it, so it is lifted out (the innermost one is returned to explain the error).
    """
    parts: list[str] = []
    tag: str | None = None
    expect_tag = False
    for segment in loc:
        if isinstance(segment, int):
            if parts:
                parts[-1] += f"[{segment}]"
            continue
        if expect_tag:
            expect_tag, tag = False, segment
            continue
        parts.append(segment)
        expect_tag = ".".join(p.split("[", 1)[0] for p in parts) in union_paths
    return ".".join(parts), tag


def _source_of(path: str, layers: Sequence[tuple[str, list[str]]]) -> str | None:
    """The last layer (file or command line) that set `path`, a key under it, or a key above it."""
    bare = ".".join(p.split("[", 1)[0] for p in path.split("."))
    for source, leaves in reversed(layers):
        for leaf in leaves:
            if leaf == bare or leaf.startswith(f"{bare}.") or bare.startswith(f"{leaf}."):
                return source
    return None


def _describe(error: Mapping[str, Any], path: str, tag: str | None) -> str:
    message = str(error.get("msg", "invalid value"))
    if error.get("type") == "extra_forbidden":
        message = f"unknown key for type {tag!r}" if tag else "unknown key"
    elif message.startswith("Value error, "):
        message = message.removeprefix("Value error, ")
    value = error.get("input")
    shown = "" if value is None or isinstance(value, dict | list) else f" (got {value!r})"
    return f"{path}: {message}{shown}" if path else f"{message}{shown}"


#: How cross-field checks name the keys they compare: `trainer.seq_len = 128 conflicts with ...`.
_STATED_KEY = re.compile(r"\b([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*) = ")


def _sources_of_stated_keys(message: str, layers: Sequence[tuple[str, list[str]]]) -> list[str]:
    """The files (or command line) that set the keys a root-level error names as `key = value`.

    A check across sections fails at the root, where the error carries no key path; without
    this the user would learn which keys clash but not which of their files set them.
    """
    sources: list[str] = []
    for key in _STATED_KEY.findall(message):
        source = _source_of(key, layers)
        if source is not None and source not in sources:
            sources.append(source)
    return sources


def format_validation_error(exc: ValidationError, layers: Sequence[tuple[str, list[str]]]) -> str:
    """One line: where the bad value came from, its key, and what is wrong with it."""
    union_paths = union_field_paths(PrimeflowConfig)
    errors = exc.errors()
    first = errors[0]
    path, tag = user_path(first.get("loc", ()), union_paths)
    source = _source_of(path, layers) if path else None
    line = _describe(first, path, tag)
    if source:
        line = f"{source}: {line}"
    elif not path and (sources := _sources_of_stated_keys(line, layers)):
        line = f"{', '.join(sources)}: {line}"
    if len(errors) > 1:
        others = sorted(
            {user_path(e.get("loc", ()), union_paths)[0] or "<root>" for e in errors[1:]}
        )
        line += f" (and {len(errors) - 1} more: {', '.join(others)})"
    return line


def load_config(args: Sequence[str], *, prog: str = "primeflow <command>") -> PrimeflowConfig:
    """Defaults < `@` files (left to right) < flags. Raises ConfigError with a one-line message.

    `--help` prints every field with its default and description, then exits 0.
    """
    files, flags = split_config_args(args)
    layers = [(path, _leaf_paths(read_toml(path))) for path in files]
    layers.append((COMMAND_LINE, _flag_paths(flags)))
    cli_args = [token for path in files for token in ("@", path)] + flags
    try:
        # pydantic_config's overloads leave out `prog`, which its `cli` takes.
        config: PrimeflowConfig = cli(PrimeflowConfig, args=cli_args, prog=prog)  # type: ignore[call-overload]
        return config
    except ConfigFileError as exc:
        if isinstance(exc.__cause__, ValidationError):
            raise ConfigError(format_validation_error(exc.__cause__, layers)) from None
        message = " ".join(exc.message.split())
        raise ConfigError(f"{COMMAND_LINE}: {message}") from None


def with_overrides(config: PrimeflowConfig, overrides: Mapping[str, Any]) -> PrimeflowConfig:
    """`config` with dotted-key overrides (`{"trainer.optim.lr": 1e-5}`), validated again.

    Only what the user set is carried over, so shared fields keep filling the sections: an
    override of `seq_len` reaches every section that did not set its own, nor merely copied
    the old value (as a config from `--dry-run` JSON does).
    """
    data = config.model_dump(exclude_unset=True)
    for dotted in overrides:
        for copy in shared_copies(config, dotted.replace("-", "_")):
            section, leaf = copy.split(".")
            data.get(section, {}).pop(leaf, None)
    for dotted, value in overrides.items():
        *parents, leaf = dotted.replace("-", "_").split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"overrides: {dotted}: {part} is not a section")
        node[leaf] = value
    try:
        return PrimeflowConfig.model_validate(data)
    except ValidationError as exc:
        layers = [("overrides", [k.replace("-", "_") for k in overrides])]
        raise ConfigError(format_validation_error(exc, layers)) from None
