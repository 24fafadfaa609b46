"""Weights & Biases tracker (monitor.trackers: wandb; the trackers extra): rank 0 logs the job config as the run's
config at the start, every metrics record at its step, and the summary into the run's summary at the end, then
finishes the run (failed: exit code 1; preempted: marked preempting). W&B's files go under the run folder's wandb/
(offline: `wandb sync runs/NAME/wandb/offline-run-*` uploads them). The run id is kept in monitor/wandb.json: a
resumed run continues the same W&B run (online; offline, W&B writes a new folder under the same id, which
`wandb sync` joins to it).

Settings: monitor.wandb_project, monitor.wandb_entity, monitor.wandb_mode (online/offline/disabled; default W&B's
own: $WANDB_MODE, else online)."""

from __future__ import annotations

import uuid
from typing import Any

from scaletrain.config.schema import MonitorConfig
from scaletrain.config.extras import require
from scaletrain.monitor.progress import log
from scaletrain.monitor.sinks import RunEnd, TrackedRun, scalars


class WandbSink:
    @staticmethod
    def check(cfg: MonitorConfig) -> None:
        require("wandb", "monitor.trackers")

    @classmethod
    def open(cls, cfg: MonitorConfig, run: TrackedRun) -> WandbSink:
        return cls(cfg, run)

    def __init__(self, cfg: MonitorConfig, run: TrackedRun):
        import wandb

        kept = run.read_id("wandb")
        same_project = kept is not None and kept.get("project") == cfg.wandb_project
        run_id = str(kept["run_id"]) if kept is not None and same_project else uuid.uuid4().hex[:8]
        options: dict[str, Any] = {"mode": cfg.wandb_mode} if cfg.wandb_mode else {}
        # console off: ranks' output already goes to logs/rank<r>.log, and W&B's capture would wrap that stream
        settings = wandb.Settings(console="off", silent=True)
        self._run = wandb.init(
            project=cfg.wandb_project,
            entity=cfg.wandb_entity,
            name=run.name,
            id=run_id,
            resume="allow",
            dir=str(run.out),
            settings=settings,
            **options,
        )
        self._run.config.update(run.config, allow_val_change=True)  # a resume may change settings (train.steps)
        run.keep_id("wandb", {"run_id": run_id, "project": cfg.wandb_project})
        # W&B refuses steps below the last one it holds: a resumed online run keeps what it logged before the stop
        self._first_step = int(self._run.starting_step or 0)
        offline = self._run.settings.mode != "online"  # W&B warns when asked for an offline run's URL
        log.info(
            "wandb: run %s (%s) in %s", run_id, self._run.settings.mode, self._run.dir if offline else self._run.url
        )

    def write(self, record: dict) -> None:
        step = record.get("step")
        if step is None or int(step) < self._first_step:
            return
        self._run.log(scalars(record), step=int(step))

    def close(self, summary: dict | None = None, end: RunEnd = "finished") -> None:
        if summary is not None:
            self._run.summary.update({k: v for k, v in summary.items() if v is not None})
        if end == "stopped":
            self._run.mark_preempting()
        self._run.finish(exit_code=1 if end == "failed" else 0)
