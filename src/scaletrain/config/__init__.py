"""The typed job config shared by the trainer, the planner and the launchers."""

from scaletrain.config.load import ConfigError, load_config, parse_override, to_toml, validate_config
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

__all__ = [
    "CheckpointConfig", "ConfigError", "DataConfig", "JobConfig", "LaunchConfig", "ModelConfig", "MonitorConfig",
    "ParallelConfig", "PrecisionConfig", "RunConfig", "TrainConfig", "load_config", "parse_override", "to_toml",
    "validate_config",
]
