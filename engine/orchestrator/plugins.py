"""`custom` advantages and filters: user callables named by `import_path`, bound to `kwargs`."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from engine.config.plugin import CustomPluginConfig


def load_plugin(config: CustomPluginConfig, where: str) -> Callable[..., Any]:
    """The callable at `config.import_path` ("package.module:attribute") with its kwargs bound.

    Errors name `where` (the config key) and what is missing, at start-up rather than at the
    first step that would call it.
    """
    module_name, _, attribute = config.import_path.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{where}.import_path: cannot import {module_name!r}: {exc}") from exc
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{where}.import_path: {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{where}.import_path: {config.import_path!r} is not callable")
    return functools.partial(target, **config.kwargs)
