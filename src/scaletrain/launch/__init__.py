"""Launchers: local ranks through the torchrun agent."""

from scaletrain.launch.local import launch_local

__all__ = ["launch_local"]
