"""MLflow tracker (monitor.trackers: mlflow; the trackers extra): rank 0 logs the job config as the run's
parameters at the start, every metrics record as metrics at its step, and the summary at the end (numbers as
`summary/KEY` metrics, the rest as `summary.KEY` tags), then ends the run FINISHED, KILLED (preempted, to be resumed)
or FAILED. The run id is kept in monitor/mlflow.json: a resumed run reopens the same MLflow run.

Settings: monitor.mlflow_tracking_uri (a tracking server, http://HOST:PORT, or a store URI; default MLflow's own),
monitor.mlflow_experiment. Through MlflowClient, not mlflow's global active run, so nothing else in the process is
touched."""

from __future__ import annotations

import time
from urllib.parse import urlparse

from scaletrain.config.schema import MonitorConfig
from scaletrain.config.extras import installed, require
from scaletrain.monitor.progress import log
from scaletrain.monitor.sinks import RunEnd, TrackedRun, flat_params, scalars

STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}
# stores MLflow opens in this process through SQLAlchemy (its default is sqlite:///mlflow.db): the full mlflow
# package brings SQLAlchemy, mlflow-skinny (scaletrain[trackers]) does not and logs to a tracking server
DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
FILE_SCHEMES = ("", "file")  # MLflow's file store: a folder path or file:///PATH


class MLflowSink:
    @staticmethod
    def check(cfg: MonitorConfig) -> None:
        """Before launch: mlflow installed, and a local database store only where SQLAlchemy is (full mlflow)."""
        import os

        require("mlflow", "monitor.trackers")
        uri = cfg.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        scheme = urlparse(uri).scheme.split("+")[0] if uri else "sqlite"
        if scheme in DATABASE_SCHEMES and not installed("sqlalchemy"):
            where = uri or "sqlite:///mlflow.db, MLflow's default"
            raise ValueError(
                f"monitor.mlflow_tracking_uri: a local store ({where}) needs the full mlflow package "
                f"(pip install mlflow); mlflow-skinny logs to a tracking server: set it to http://HOST:PORT"
            )

    @classmethod
    def open(cls, cfg: MonitorConfig, run: TrackedRun) -> MLflowSink:
        return cls(cfg, run)

    def __init__(self, cfg: MonitorConfig, run: TrackedRun):
        import os

        from mlflow import MlflowClient

        uri = cfg.mlflow_tracking_uri
        if uri is not None and urlparse(uri).scheme in FILE_SCHEMES:
            # MLflow 3.x refuses its file store unless opted in; monitor.mlflow_tracking_uri=file:... is that opt-in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")

        self._client = MlflowClient(tracking_uri=cfg.mlflow_tracking_uri)
        uri = self._client.tracking_uri
        kept = run.read_id("mlflow")
        if kept is not None and kept.get("tracking_uri") == uri:
            self.run_id = str(kept["run_id"])
            self._client.update_run(self.run_id, status="RUNNING")
            logged = self._client.get_run(self.run_id).data.params
            log.info("mlflow: continuing run %s at %s", self.run_id, uri)
        else:
            experiment = self._client.get_experiment_by_name(cfg.mlflow_experiment)
            experiment_id = (
                experiment.experiment_id if experiment else self._client.create_experiment(cfg.mlflow_experiment)
            )
            tags = {"scaletrain.run_dir": str(run.out.resolve())}
            self.run_id = self._client.create_run(experiment_id, run_name=run.name, tags=tags).info.run_id
            run.keep_id("mlflow", {"run_id": self.run_id, "tracking_uri": uri, "experiment_id": experiment_id})
            logged = {}
            log.info("mlflow: run %s in experiment %r at %s", self.run_id, cfg.mlflow_experiment, uri)
        self._log_params(flat_params(run.config), logged)
        self._failed_once = False

    def _log_params(self, params: dict[str, str], logged: dict[str, str]) -> None:
        """The config as parameters; MLflow's are write-once, so a resumed run keeps the values it started with
        and says which ones the resume changed."""
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        new = {k: v[:MAX_PARAM_VAL_LENGTH] for k, v in params.items() if k not in logged}
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v[:MAX_PARAM_VAL_LENGTH])
        if changed:
            log.warning("mlflow: parameters keep their first values; changed on resume: %s", ", ".join(changed))
        self._client.log_batch(self.run_id, params=[Param(k, v) for k, v in new.items()])

    def write(self, record: dict) -> None:
        from mlflow.entities import Metric

        step = record.get("step")
        if step is None:
            return
        now_ms = int(time.time() * 1000)
        metrics = [Metric(key, value, now_ms, int(step)) for key, value in scalars(record).items()]
        try:
            self._client.log_batch(self.run_id, metrics=metrics)
        except Exception as e:  # the tracker is a copy: metrics.jsonl holds the record, training goes on
            if not self._failed_once:
                log.warning("mlflow: logging step %d failed (%s); training goes on, metrics.jsonl has it", step, e)
            self._failed_once = True

    def close(self, summary: dict | None = None, end: RunEnd = "finished") -> None:
        from mlflow.entities import Metric, RunTag
        from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

        try:
            if summary is not None:
                now_ms, step = int(time.time() * 1000), int(summary.get("steps") or 0)
                numbers = scalars(summary)
                metrics = [Metric(f"summary/{k}", v, now_ms, step) for k, v in numbers.items()]
                tags = [
                    RunTag(f"summary.{k}", str(v)[:MAX_TAG_VAL_LENGTH])
                    for k, v in summary.items()
                    if k not in numbers and v is not None
                ]
                self._client.log_batch(self.run_id, metrics=metrics, tags=tags)
            self._client.set_terminated(self.run_id, status=STATUS[end])
        except Exception as e:  # summary.json holds the summary; a failed run's own error stays the one reported
            log.warning("mlflow: ending run %s failed (%s); summary.json has the summary", self.run_id, e)
