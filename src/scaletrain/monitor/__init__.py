"""Rank-0 output and metric sinks."""

from scaletrain.monitor.metrics import JsonlSink, read_jsonl
from scaletrain.monitor.progress import StepProgress, configure_logging, log

__all__ = ["JsonlSink", "StepProgress", "configure_logging", "log", "read_jsonl"]
