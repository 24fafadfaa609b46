"""Reading a job config: TOML file, then `section.key=value` overrides, then validation.

Errors a user can cause become one `ConfigError` line naming the field and the fix.
"""

from __future__ import annotations

import tomllib
import typing
from pathlib import Path
from typing import Any

import tomli_w
from pydantic import BaseModel, ValidationError

from scaletrain.config.errors import ConfigError
from scaletrain.config.schema import JobConfig
from scaletrain.config.toml_file import read_toml


def _section_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The model class a validation error's location (minus its last part) points into, through nested models and
    dict-of-model fields; None where the path leaves models."""
    current: Any = root
    for part in loc:
        if isinstance(current, type) and issubclass(current, BaseModel) and str(part) in current.model_fields:
            current = current.model_fields[str(part)].annotation
        elif typing.get_origin(current) is dict:
            current = typing.get_args(current)[1]  # `part` is a key of the dict
        else:
            return None
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def validation_error_line(err: ValidationError, root: type[BaseModel] = JobConfig, where: str = "config") -> str:
    """A pydantic ValidationError of `root` as one line: the dotted field, what is wrong, the value given, and for
    unknown keys the valid ones (shared by job configs and cluster files)."""
    first = err.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or where
    if first["type"] == "extra_forbidden":
        section = _section_at(root, first["loc"][:-1])
        valid = f"; valid keys here: {', '.join(section.model_fields)}" if section is not None else ""
        return f"{field}: unknown key{valid}"
    msg = first["msg"]
    if msg.startswith("Value error, "):
        msg = msg.removeprefix("Value error, ")
        # validators already name their field
        return msg if msg.split(":")[0].count(".") else f"{field}: {msg}"
    got = first.get("input")
    shown = "" if isinstance(got, dict) else f" (got {got!r})"
    return f"{field}: {msg[0].lower()}{msg[1:]}{shown}"


def parse_override(text: str) -> tuple[list[str], Any]:
    """`train.lr=3e-4` -> (["train", "lr"], 0.0003). Values are TOML literals; bare words are strings."""
    if "=" not in text:
        raise ConfigError(f"{text}: an override must look like section.key=value (e.g. train.steps=100)")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".")]
    if len(path) < 2 or not all(path):
        raise ConfigError(f"{key}: an override key must be section.key (e.g. train.steps)")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return path, value


def split_config_args(args: list[str] | tuple[str, ...]) -> tuple[str | None, list[str]]:
    """`[CONFIG.toml] [section.key=value ...]` -> (the TOML path or None, the overrides): the first argument is a
    file unless it is an override."""
    path = args[0] if args and "=" not in args[0] else None
    return path, list(args[1:] if path else args)


def _set(tree: dict, path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path)}: {part} is a value, not a section")
        node = child
    node[path[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Build a validated JobConfig from an optional TOML file and `key=value` overrides."""
    tree: dict[str, Any] = {}
    if path is not None:
        tree = read_toml(path, "config file")
    for text in overrides:
        key, value = parse_override(text)
        _set(tree, key, value)
    return validate_config(tree)


def validate_config(tree: dict[str, Any]) -> JobConfig:
    try:
        return JobConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(validation_error_line(e)) from None


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML that `load_config` reads back to an equal config (None fields omitted)."""
    return tomli_w.dumps(cfg.model_dump(exclude_none=True))
