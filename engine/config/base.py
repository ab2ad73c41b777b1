"""The base every config section derives from.

`pydantic_config.BaseConfig` forbids unknown keys (a typo is an error, not a silent default) and
lets TOML say `"None"`; primeflow adds nothing else, so every section reads like plain pydantic.
"""

from __future__ import annotations

from pydantic_config import BaseConfig

__all__ = ["BaseConfig"]
