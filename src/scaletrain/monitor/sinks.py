"""Where rank 0's metrics records go: metrics.jsonl always (the run's record of truth), TensorBoard event files when
monitor.tensorboard, then each tracker of monitor.trackers, one module each behind the one `Sink` interface:

    sink = open_sinks(cfg.monitor, TrackedRun(out, name, start_step, config))   # rank 0; trackers log the config
    sink.write(record)                          # every metrics record, at its step
    sink.close(summary, "finished")             # the run summary; "stopped" (preempted) or "failed" without one

A tracker that can resume its own run (MLflow's run id, W&B's) keeps its id in the run folder's monitor/, which a
fresh run clears (run_record.py), so a resumed run continues the same tracker run and a fresh one starts another.
"""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from scaletrain.config.schema import MonitorConfig
from scaletrain.monitor.metrics import JsonlSink
from scaletrain.monitor.run_record import is_resumed

RunEnd = Literal["finished", "stopped", "failed"]  # stopped: preempted, to be resumed; failed: an error ended it

# monitor.trackers name -> "module:class" of its sink (imported only when the tracker is asked for)
TRACKERS = {
    "mlflow": "scaletrain.monitor.mlflow_sink:MLflowSink",
    "wandb": "scaletrain.monitor.wandb_sink:WandbSink",
}


class Sink(Protocol):
    def write(self, record: dict) -> None:
        """One metrics record: `step` and the figures logged at it."""

    def close(self, summary: dict | None = None, end: RunEnd = "finished") -> None:
        """The run summary (summary.json's content; None when the run stopped or failed) and how the run ended."""


@dataclass(frozen=True)
class TrackedRun:
    """What a tracker is told when it opens: the run folder, the run's name, the step it starts after (0: a fresh
    run) and the resolved job config (nested sections, as config.toml holds it)."""

    out: Path
    name: str
    start_step: int
    config: dict[str, Any]

    @property
    def resumed(self) -> bool:
        return is_resumed(self.start_step)

    def read_id(self, tracker: str) -> dict | None:
        """The tracker run this resumed run continues (monitor/<tracker>.json), or None (a fresh run, or none kept)."""
        path = self.out / "monitor" / f"{tracker}.json"
        if not self.resumed or not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except ValueError:
            return None

    def keep_id(self, tracker: str, ids: dict) -> None:
        """Remember the tracker's run in monitor/<tracker>.json, for a resume to continue it."""
        path = self.out / "monitor" / f"{tracker}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(ids, indent=1) + "\n")


def sink_class(tracker: str) -> Any:
    module, name = TRACKERS[tracker].split(":")
    return getattr(importlib.import_module(module), name)


def check_trackers(cfg: MonitorConfig) -> None:
    """Before launch: each tracker of monitor.trackers can open (its library installed, its settings usable);
    ValueError, one line naming the field and the fix, otherwise."""
    for tracker in cfg.trackers:
        check = getattr(sink_class(tracker), "check", None)
        if check is not None:
            check(cfg)


def open_sinks(cfg: MonitorConfig, run: TrackedRun) -> MultiSink:
    """metrics.jsonl (continued when the run resumed), TensorBoard (monitor.tensorboard), then each tracker of
    monitor.trackers. Rank 0 only."""
    sinks: list[Sink] = [JsonlSink(run.out / "metrics.jsonl", append=run.resumed)]
    try:
        if cfg.tensorboard:
            from scaletrain.monitor.tensorboard import TensorBoardSink

            # purge_step drops the events a resumed run recomputes after its checkpoint
            sinks.append(
                TensorBoardSink(run.out / "tensorboard", purge_step=run.start_step + 1 if run.resumed else None)
            )
        for tracker in cfg.trackers:
            sinks.append(sink_class(tracker).open(cfg, run))
    except BaseException:
        MultiSink(sinks).close(None, "failed")
        raise
    return MultiSink(sinks)


class MultiSink:
    """Writes every record to each sink (JSONL first: it is the run's record of truth)."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks

    def write(self, record: dict) -> None:
        for s in self.sinks:
            s.write(record)

    def close(self, summary: dict | None = None, end: RunEnd = "finished") -> None:
        for s in self.sinks:
            s.close(summary, end)


def scalars(record: dict) -> dict[str, float]:
    """A record's figures as trackers take them: every number but `step` under its own key, and per-rank lists
    (peak_mem_bytes_per_rank, ...) as one figure per rank, `KEY/rankN`."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[key] = float(value)
        elif isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            out.update({f"{key}/rank{rank}": float(v) for rank, v in enumerate(value)})
    return out


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The job config as `section.key` -> value text (MLflow's parameters): nested sections flattened, lists as
    JSON, non-finite floats as their names."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_params(value, f"{name}."))
        elif isinstance(value, float) and not math.isfinite(value):
            out[name] = str(value)
        elif isinstance(value, (list, dict)):
            out[name] = json.dumps(value)
        else:
            out[name] = str(value)
    return out
