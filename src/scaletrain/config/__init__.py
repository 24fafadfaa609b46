"""The typed job config shared by the trainer, the planner and the launchers.

Names are loaded on first use (pydantic builds the schema then): `scaletrain --help` imports config.errors only.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scaletrain.config.errors import ConfigError
    from scaletrain.config.load import (
        load_config,
        parse_override,
        split_config_args,
        to_toml,
        validate_config,
    )
    from scaletrain.config.schema import (
        CheckpointConfig,
        DataConfig,
        JobConfig,
        LaunchConfig,
        ModelConfig,
        MonitorConfig,
        ParallelConfig,
        PrecisionConfig,
        RunConfig,
        TrainConfig,
    )

_HOME = {
    "ConfigError": "errors",
    **dict.fromkeys(("load_config", "parse_override", "split_config_args", "to_toml", "validate_config"), "load"),
    **dict.fromkeys(
        (
            "CheckpointConfig",
            "DataConfig",
            "JobConfig",
            "LaunchConfig",
            "ModelConfig",
            "MonitorConfig",
            "ParallelConfig",
            "PrecisionConfig",
            "RunConfig",
            "TrainConfig",
        ),
        "schema",
    ),
}

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "JobConfig",
    "LaunchConfig",
    "ModelConfig",
    "MonitorConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "RunConfig",
    "TrainConfig",
    "load_config",
    "parse_override",
    "split_config_args",
    "to_toml",
    "validate_config",
]


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'scaletrain.config' has no attribute {name!r}")
    return getattr(importlib.import_module(f"scaletrain.config.{_HOME[name]}"), name)
