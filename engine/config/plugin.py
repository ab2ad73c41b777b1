"""`custom` variants: user code named by an import path, with keyword arguments from the config."""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from engine.config.base import BaseConfig

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


class CustomPluginConfig(BaseConfig):
    """Selects user code by `import_path` ("package.module:function") plus its `kwargs`."""

    type: Literal["custom"] = "custom"
    import_path: Annotated[
        str,
        Field(description="Where the code lives: 'package.module:attribute'."),
    ]
    kwargs: Annotated[
        dict[str, Any], Field(description="Keyword arguments passed to it (JSON on the CLI).")
    ] = {}

    @field_validator("import_path")
    @classmethod
    def _import_path_shape(cls, value: str) -> str:
        """Checked here rather than with `Field(pattern=...)`, whose error shows the regex."""
        if not _IMPORT_PATH.fullmatch(value):
            raise ValueError("must look like 'package.module:function' (module, colon, name)")
        return value

    def load(self, where: str) -> Callable[..., Any]:
        """The callable at `import_path` with `kwargs` bound.

        Errors name `where` (the config key) and what is missing, at start-up rather than at
        the first step that would call it.
        """
        module_name, _, attribute = self.import_path.partition(":")
        try:
            target: Any = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"{where}.import_path: cannot import {module_name!r}: {exc}") from exc
        for part in attribute.split("."):
            if not hasattr(target, part):
                raise ValueError(
                    f"{where}.import_path: {module_name!r} has no attribute {attribute!r}"
                )
            target = getattr(target, part)
        if not callable(target):
            raise ValueError(f"{where}.import_path: {self.import_path!r} is not callable")
        return functools.partial(target, **self.kwargs)
