"""Strict, one-line validation of a config section's open keys against the dataclass of whoever owns them: a model
family's args (`[model]`), a task's options (`[task]`). The section itself (config/schema.py) only names the keys
that choose the owner; the owner, found later, declares the rest with its own typed fields."""

from __future__ import annotations

import dataclasses
import typing
from functools import lru_cache
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, create_model


def settable(fields_type: type) -> list[dataclasses.Field]:
    """The fields a config section may set: all but those marked `metadata={"config": False}`."""
    return [f for f in dataclasses.fields(fields_type) if f.metadata.get("config", True)]


@lru_cache(maxsize=None)
def _fields_model(fields_type: type, section: str) -> type[BaseModel]:
    """A strict pydantic model of `fields_type`'s fields (every one optional: a section sets some of them), nested
    under `section` so error locations read `section.field`."""
    hints = typing.get_type_hints(fields_type, include_extras=True)
    fields: dict[str, Any] = {f.name: (hints[f.name] | None, None) for f in settable(fields_type)}
    config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    inner = create_model(f"{fields_type.__name__}Fields", __config__=config, **fields)
    outer: dict[str, Any] = {section: (inner, ...)}
    return create_model(f"{fields_type.__name__}Section", __config__=config, **outer)


def check_fields(section: str, owner: str, fields_type: type, values: dict[str, Any]) -> dict[str, Any]:
    """`values` (keys of `section` besides those that chose the owner) checked against the dataclass `fields_type`:
    an unknown key or a wrongly typed value (strict: "3" is not an int, 1.5 is not an int) is a ValueError of one
    line naming `section.key`; returns the values as validated. `owner` says whose fields they are, e.g. "llama
    family"."""
    known = sorted(f.name for f in settable(fields_type))
    for key in values:
        if key not in known:
            listed = ", ".join(known) if known else "none"
            raise ValueError(f"{section}.{key}: the {owner} has no such field; it has {listed}")
    try:
        validated = _fields_model(fields_type, section).model_validate({section: values})
    except ValidationError as e:
        from scaletrain.config.load import validation_error_line

        raise ValueError(validation_error_line(e, where=section)) from None
    inner = getattr(validated, section)
    return {key: getattr(inner, key) for key in values}
