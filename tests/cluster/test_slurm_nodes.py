"""A two-node Slurm on simulated nodes (tests/cluster/slurm_nodes.py: munged + slurmctld in node 0, one slurmd per
node, Debian's slurm-wlm): `scaletrain launch slurm --nodes 2 --submit`, submitted from node 0, runs one agent per
node (2 CPU ranks each) with the rendezvous at node 0's address; Slurm's advance warning (SIGUSR1 to the batch
shell) preempts it mid-run, the job is requeued, resumes on both nodes from the checkpoint and finishes with every
step's loss equal to the single-process run's. One job covers both, to keep the wall time small."""

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from cluster_nodes import make_cluster
from conftest import FAST, losses
from scaletrain.monitor import read_jsonl
from slurm_nodes import make_slurm

STEPS = 20
# conftest's small, fast job (its one evaluation batch included), long enough to be preempted mid-run
JOB = [
    *FAST,
    f"train.steps={STEPS}",
    "model.name=tiny",
    "train.eval_interval=0",
    "checkpoint.interval_steps=1000",  # the only checkpoint before the end is the preemption's
]
TOL = 1e-5
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


@pytest.fixture(scope="module")
def cluster():
    yield from make_cluster(2)


@pytest.fixture(scope="module")
def slurm(cluster):
    yield from make_slurm(cluster)


def _steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    return [r["step"] for r in read_jsonl(path) if "loss" in r] if path.exists() else []


def _wait(slurm, job_id: str, done, what: str, timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    info: dict[str, str] = {}
    while time.monotonic() < deadline:
        info = slurm.job(job_id)
        if done(info):
            return info
        time.sleep(0.3)
    raise AssertionError(f"job {job_id}: {what} not reached in {timeout:.0f} s; last state {info.get('JobState')}")


@pytest.mark.slow
def test_two_node_job_is_preempted_and_resumes_on_both_nodes(slurm, tmp_path: Path) -> None:
    # the single-process reference runs on the host meanwhile, on one thread: two OpenMP threads fighting the
    # job's four ranks for 2 cores made its steps 10x slower
    ref_err = tmp_path / "single.err"
    with ref_err.open("w") as err:
        ref = subprocess.Popen(
            [sys.executable, "-m", "scaletrain.cli.main", "train", *JOB, "run.name=single", "--nproc-per-node", "1"],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    launch = [sys.executable, "-m", "scaletrain.cli.main", "launch", "slurm", *JOB, "run.name=two"]
    launch += ["--nodes", "2", "--gpus-per-node", "0", "--nproc-per-node", "2", "--time", "30:00"]
    launch += ["--signal-lead", "60", "--submit"]
    job_id = slurm.run(launch, cwd=tmp_path, timeout=120).stdout.strip().splitlines()[-1]
    assert job_id.isdigit(), job_id
    run = tmp_path / "runs" / "two"
    log = run / f"slurm-{job_id}.out"
    try:
        deadline = time.monotonic() + 240
        while len(_steps(run)) < 2 and time.monotonic() < deadline:
            assert slurm.job(job_id).get("JobState") not in DONE, log.read_text()[-3000:]
            time.sleep(0.2)
        assert _steps(run), f"the job never started training: {slurm.job(job_id)}\n{slurm.logs()}"
        # what Slurm does --signal-lead seconds before the time limit: SIGUSR1 to the batch shell only
        slurm.run(["scancel", "--signal=USR1", "--batch", job_id])
        preempted_at = time.time()
        _wait(slurm, job_id, lambda j: j.get("Restarts", "0") != "0", "requeue", timeout=180)
        saved = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
        assert saved, "no checkpoint saved on preemption"
        stopped_at = int(saved[-1].split("_")[1])
        assert 0 < stopped_at < STEPS
        info = _wait(slurm, job_id, lambda j: j.get("JobState") in DONE, "completion after requeue", timeout=300)
    finally:
        slurm.run(["scancel", job_id], check=False)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", text[-4000:]
    for attempt in (1, 2):  # one agent per node, the rendezvous at node 0's address (its NodeAddr)
        assert f"attempt {attempt} on 2 node(s), rendezvous {slurm.cluster.nodes[0].addr}:" in text, text[-4000:]
    assert "requeueing job" in text and f"at step {stopped_at}" in text, text[-4000:]

    # the rerun ran on both nodes again: every rank's heartbeat is from after the preemption, 2 ranks per node
    beats = [json.loads(p.read_text()) for p in sorted((run / "heartbeat").glob("rank*.json"))]
    assert all(b["started"] > preempted_at for b in beats), beats
    assert Counter(b["host"] for b in beats) == {"node0": 2, "node1": 2}, beats
    assert json.loads((run / "summary.json").read_text())["world_size"] == 4

    logged = _steps(run)
    assert logged == list(range(1, STEPS + 1))  # every step once, across both attempts
    assert ref.wait(timeout=300) == 0, ref_err.read_text()[-3000:]
    want, got = losses(tmp_path / "runs" / "single"), losses(run)
    assert len(want) == len(got) == STEPS
    for step, (a, b) in enumerate(zip(want, got), 1):
        assert abs(a - b) <= TOL, f"step {step}: {b} on two Slurm nodes vs single-process {a}"
