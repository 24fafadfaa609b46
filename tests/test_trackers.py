"""monitor.trackers beside TensorBoard: one 2-rank run logs to MLflow (a real tracking server the test starts, from
the venv tests/mlflow/install.sh makes; without it, a file store in a temp folder) and to Weights & Biases offline (its files under the run folder), is resumed, and both trackers are read back: one
tracker run (rank 0 only) continued by the resume, the config as parameters / config, every metrics record at its
step, the summary at the end. A missing extra is one line naming it, exit 2, before launch (the library hidden in
sys.modules)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli, run_cli_in_process

from scaletrain.monitor import read_jsonl

RUN = [
    "train.global_batch_size=8",
    "data.seq_len=32",
    "data.max_bytes=200000",
    "train.warmup_steps=1",
    "train.eval_batches=1",
    "train.eval_interval=2",
    "monitor.log_interval=1",
    "monitor.progress=false",
    "monitor.sample_interval_s=0",
    "checkpoint.save_final=true",
    "checkpoint.async_save=false",
    "run.name=tracked",
]


def wandb_records(path: Path):
    """The records of an offline W&B run file (run-ID.wandb): W&B's LevelDB-style log, 32 KiB blocks of chunks
    with a 7-byte header (checksum, length, type: full, first, middle, last) after the file's own 7-byte header."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", path
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the rest of a block too short for a header is padding
            pos += block - pos % block
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            pending = chunk
        elif kind in (3, 4):
            pending += chunk
        else:
            break
        if kind in (1, 4):
            yield wandb_internal_pb2.Record.FromString(pending)


def wandb_history(path: Path) -> dict[int, dict]:
    """step -> the figures logged at it, from an offline run file."""
    rows: dict[int, dict] = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows.setdefault(record.history.step.num, {}).update(items)
    return rows


def wandb_folders(root: Path, run_id: str) -> list[Path]:
    """The offline folders of one W&B run, oldest first; a second attempt started within the same second as the first
    gets W&B's `-1` suffix (offline-run-<time>-<id>-1)."""
    return [f for f in sorted((root / "wandb").glob("offline-run-*")) if run_id in f.name.split("-")]


def wandb_updates(path: Path, kind: str) -> dict:
    """The config or summary of an offline run file, every update applied in order."""
    out: dict = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == kind:
            for item in getattr(record, kind).update:
                out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


SERVER = Path(__file__).resolve().parents[1] / ".venv-mlflow" / "bin" / "mlflow"  # tests/mlflow/install.sh


@contextlib.contextmanager
def mlflow_server(folder: Path):
    """A real tracking server (`mlflow server` from tests/mlflow/install.sh's venv, a SQLite store and artifacts in
    `folder`) on a free local port; yields its http:// URI and stops it after."""
    import urllib.request

    from scaletrain.launch.local import free_port

    port = free_port()
    proc = subprocess.Popen(
        [str(SERVER), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
        + ["--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}", "--artifacts-destination", str(folder / "art")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # 30 s here beside a full -n auto run; the import of its server is slow
        while True:
            try:
                if urllib.request.urlopen(f"{uri}/health", timeout=2).read() == b"OK":
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "mlflow server did not start"
            time.sleep(0.2)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.mark.slow  # two 2-rank launches (fresh, resumed) and a tracking server; the sinks alone are tested fast below
def test_mlflow_and_wandb_log_config_metrics_and_summary_and_continue_on_resume(tmp_path, monkeypatch):
    """Against a real MLflow tracking server when tests/mlflow/install.sh has installed one (CI does), else MLflow's
    file store."""
    with contextlib.ExitStack() as stack:
        if SERVER.exists():
            store = stack.enter_context(mlflow_server(tmp_path / "server"))
        else:
            monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # what the sink sets for a file store
            store = (tmp_path / "mlruns").as_uri()
        _trackers_through_a_resumed_run(tmp_path, store)


def _trackers_through_a_resumed_run(tmp_path: Path, store: str) -> None:
    from mlflow import MlflowClient

    trackers = [
        "monitor.trackers=mlflow,wandb",
        f"monitor.mlflow_tracking_uri={store}",
        "monitor.mlflow_experiment=trackers-test",
        "monitor.wandb_mode=offline",
        "monitor.wandb_project=trackers-test",
    ]
    run_cli(["train", *RUN, *trackers, "train.steps=4"], cwd=tmp_path, timeout=300)
    run = tmp_path / "runs" / "tracked"
    first_wandb = json.loads((run / "monitor" / "wandb.json").read_text())
    proc = run_cli(
        ["train", *RUN, *trackers, "train.steps=6"], cwd=tmp_path, timeout=300
    )  # resumes from step 4's checkpoint
    assert "resumed from" in (run / "logs" / "rank0.log").read_text(), proc.stderr[-2000:]
    records = read_jsonl(run / "metrics.jsonl")
    loss = {r["step"]: r["loss"] for r in records if "loss" in r}
    val_loss = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    summary = json.loads((run / "summary.json").read_text())
    assert sorted(loss) == [1, 2, 3, 4, 5, 6] and sorted(val_loss) == [2, 4, 6]

    # MLflow, read back through its client from the store: one run (rank 0 alone logs), continued by the resume
    client = MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("trackers-test")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    mlflow_run = runs[0]
    assert mlflow_run.info.run_id == json.loads((run / "monitor" / "mlflow.json").read_text())["run_id"]
    assert mlflow_run.info.run_name == "tracked" and mlflow_run.info.status == "FINISHED"
    params = mlflow_run.data.params
    assert params["train.global_batch_size"] == "8" and params["data.seq_len"] == "32"
    assert params["model.name"] == "tiny" and json.loads(params["monitor.trackers"]) == ["mlflow", "wandb"]
    assert params["train.steps"] == "4"  # MLflow's parameters are write-once: the first run's value stays
    history = {m.step: m.value for m in client.get_metric_history(mlflow_run.info.run_id, "loss")}
    assert history == pytest.approx(loss)
    val_history = {m.step: m.value for m in client.get_metric_history(mlflow_run.info.run_id, "val_loss")}
    assert val_history == pytest.approx(val_loss)
    assert {"tokens_per_s", "lr", "grad_norm", "peak_mem_bytes_per_rank/rank1"} <= set(mlflow_run.data.metrics)
    assert mlflow_run.data.metrics["summary/final_loss"] == pytest.approx(summary["final_loss"])
    assert mlflow_run.data.metrics["summary/val_loss"] == pytest.approx(summary["val_loss"])
    assert mlflow_run.data.tags["summary.layout"] == summary["layout"]

    # W&B offline: its folders under the run folder, one per attempt, both under the run id the resume kept
    wandb_id = json.loads((run / "monitor" / "wandb.json").read_text())["run_id"]
    assert wandb_id == first_wandb["run_id"]
    folders = wandb_folders(run, wandb_id)
    assert len(folders) == 2, list((run / "wandb").iterdir())
    first, resumed = (next(f.glob(f"run-{wandb_id}.wandb")) for f in folders)
    steps = {**wandb_history(first), **wandb_history(resumed)}
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    assert {s: row["loss"] for s, row in steps.items()} == pytest.approx(loss)
    assert {s: row["val_loss"] for s, row in steps.items() if "val_loss" in row} == pytest.approx(val_loss)
    config = wandb_updates(first, "config")
    assert config["train"]["steps"] == 4 and config["data"]["seq_len"] == 32
    assert wandb_updates(resumed, "config")["train"]["steps"] == 6
    assert wandb_updates(resumed, "summary")["final_loss"] == pytest.approx(summary["final_loss"])
    # TensorBoard is still there beside them
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


def test_sinks_in_one_process_and_a_fresh_run_starts_new_tracker_runs(tmp_path, monkeypatch):
    """The sinks rank 0 opens, driven directly (no launch): a fresh run, a resumed one that continues both tracker
    runs, and a fresh run in the same folder, whose cleared monitor/ starts new ones; a stopped run ends KILLED."""
    from mlflow import MlflowClient

    from scaletrain.config.schema import MonitorConfig
    from scaletrain.monitor.run_record import begin_run
    from scaletrain.monitor.sinks import TrackedRun, open_sinks

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # what the sink sets for a file store, for this reader
    store = (tmp_path / "mlruns").as_uri()
    cfg = MonitorConfig(
        trackers=["mlflow", "wandb"], mlflow_tracking_uri=store, wandb_mode="offline", tensorboard=False
    )
    out = tmp_path / "run"
    config = {"train": {"steps": 2}, "monitor": {"trackers": ["mlflow", "wandb"]}}

    def attempt(start: int, steps: int, end: str = "finished") -> None:
        begin_run(out, 0, start)
        sink = open_sinks(cfg, TrackedRun(out, "one", start, config))
        for step in range(start + 1, steps + 1):
            sink.write({"step": step, "loss": 1.0 / step, "peak_mem_bytes_per_rank": [10, 20], "note": "text"})
        sink.close({"steps": steps, "final_loss": 1.0 / steps, "layout": "fsdp"} if end == "finished" else None, end)

    attempt(0, 2, "stopped")
    first = json.loads((out / "monitor" / "wandb.json").read_text())["run_id"]
    attempt(2, 4)
    client = MlflowClient(tracking_uri=store)
    (experiment,) = client.search_experiments(filter_string="name = 'scaletrain'")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["train.steps"] == "2"
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    assert history == pytest.approx({s: 1.0 / s for s in (1, 2, 3, 4)})
    assert run.data.metrics["peak_mem_bytes_per_rank/rank1"] == 20 and "note" not in run.data.metrics
    assert run.data.metrics["summary/final_loss"] == 0.25 and run.data.tags["summary.layout"] == "fsdp"
    assert json.loads((out / "monitor" / "wandb.json").read_text())["run_id"] == first
    folders = wandb_folders(out, first)
    assert len(folders) == 2, folders
    # W&B's service process writes an offline run's file after finish() returns (seen: a 7-byte file, its header
    # only, read right after the second attempt's finish; complete moments later): wait for it, with a deadline
    deadline = time.monotonic() + 60
    while True:
        steps = {k: v for f in folders for k, v in wandb_history(next(f.glob("run-*.wandb"))).items()}
        if sorted(steps) == [1, 2, 3, 4] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {s: row["loss"] for s, row in steps.items()} == pytest.approx({s: 1.0 / s for s in (1, 2, 3, 4)})

    attempt(0, 1)  # a fresh run in the same folder: the ids kept were cleared with the last run's outputs
    assert len(client.search_runs([experiment.experiment_id])) == 2
    assert json.loads((out / "monitor" / "wandb.json").read_text())["run_id"] != first
    assert not wandb_folders(out, first)


@pytest.mark.parametrize(
    ("hidden", "args", "message"),
    [
        (
            "mlflow",
            ["monitor.trackers=mlflow"],
            "monitor.trackers: needs mlflow, which is not installed; pip install 'scaletrain[trackers]'",
        ),
        (
            "wandb",
            ["monitor.trackers=wandb"],
            "monitor.trackers: needs wandb, which is not installed; pip install 'scaletrain[trackers]'",
        ),
        (
            "transformers",
            ["model.hf=no_such_folder"],
            "model.hf: needs transformers, which is not installed; pip install 'scaletrain[hf]'",
        ),
        (
            "sqlalchemy",
            ["monitor.trackers=mlflow", "monitor.mlflow_tracking_uri=sqlite:///mlflow.db"],
            "monitor.mlflow_tracking_uri: a local store (sqlite:///mlflow.db) needs the full mlflow package (pip "
            "install mlflow); mlflow-skinny logs to a tracking server: set it to http://HOST:PORT",
        ),
    ],
)
def test_a_missing_extra_is_one_line_naming_it_before_launch(tmp_path, monkeypatch, hidden, args, message):
    monkeypatch.setitem(sys.modules, hidden, None)  # what `import` and find_spec see when it is not installed
    proc = run_cli_in_process(["train", *args], cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert proc.stderr == f"scaletrain: error: {message}\n"
    assert not (tmp_path / "runs").exists()
