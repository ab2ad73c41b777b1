"""`custom` variants: user code named by an import path, with keyword arguments from the config."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field

from engine.config.base import BaseConfig

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


class CustomPluginConfig(BaseConfig):
    """Selects user code by `import_path` ("package.module:function") plus its `kwargs`."""

    type: Literal["custom"] = "custom"
    import_path: Annotated[
        str,
        Field(
            pattern=_IMPORT_PATH.pattern,
            description="Where the code lives: 'package.module:attribute'.",
        ),
    ]
    kwargs: Annotated[
        dict[str, Any], Field(description="Keyword arguments passed to it (JSON on the CLI).")
    ] = {}
