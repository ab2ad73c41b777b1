"""The base every config section derives from.

`pydantic_config.BaseConfig` forbids unknown keys (a typo is an error, not a silent default) and
lets TOML and the command line say `"None"`. Users also write `null` (JSON's and YAML's
spelling): for a field that may be None it means None, not the four-letter string, so
`--sft.data.path null` unsets the path. A field that cannot be None keeps `"null"` as text.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import model_validator
from pydantic.fields import FieldInfo
from pydantic_config import BaseConfig as _PydanticConfigBase

__all__ = ["DEFAULT_MAX_STEPS", "DEFAULT_SEQ_LEN", "BaseConfig"]

#: The shared `seq_len` and `max_steps` when unset. A section's copy of a shared field defaults
#: to the same value, and the root fills it with the shared one unless the section sets its own,
#: so a section is complete on its own (no None to check) and the UI's form requires nothing.
DEFAULT_SEQ_LEN = 2048
DEFAULT_MAX_STEPS = 100


def _allows_none(field: FieldInfo | None) -> bool:
    if field is None:
        return False
    annotation = field.annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return type(None) in typing.get_args(annotation)
    return annotation is type(None)


class BaseConfig(_PydanticConfigBase):
    @model_validator(mode="before")
    @classmethod
    def _null_is_none(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, value in data.items():
                if value == "null" and _allows_none(cls.model_fields.get(key)):
                    data[key] = None
        return data
