"""Rank-0 output, metric sinks, the step-time breakdown, device sampling, profiling and the diagnosis."""

from scaletrain.monitor.metrics import JsonlSink, read_jsonl
from scaletrain.monitor.progress import StepProgress, configure_logging, log

__all__ = ["JsonlSink", "StepProgress", "configure_logging", "log", "read_jsonl"]
