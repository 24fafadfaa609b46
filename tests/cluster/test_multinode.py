"""Two simulated nodes (network namespaces, 2 CPU ranks each, link shaped to 1 Gbit/s), one `scaletrain train`
agent per node on the documented path `--nnodes 2 --rdzv-endpoint ADDR:PORT`: every cross-node layout matches
the single-process loss, a node with another config is refused in one line, and a killed node (agent and ranks)
is recovered from, with the node back (bit-identical weights) or without it (elastic `--nnodes 1:2`)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cluster_nodes import make_cluster
from conftest import FAST, losses, run_cli
from scaletrain.checkpoint.export import load_full_model_state
from scaletrain.monitor import read_jsonl
from scaletrain.train.fingerprint import compare

STEPS = 8
# conftest's small, fast job (its one evaluation batch included), with checkpoints every 2 steps to recover from
JOB = [
    *FAST,
    f"train.steps={STEPS}",
    "train.eval_interval=0",
    "checkpoint.interval_steps=2",
    "checkpoint.save_final=true",
]
ENDPOINT = "198.51.100.1:29400"
TOL = 1e-5


@pytest.fixture(scope="module")
def cluster():
    yield from make_cluster(2, rate="1gbit")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("multinode")
    run_cli(["train", *JOB, "run.name=single", "--nproc-per-node", "1"], cwd)
    return cwd


def _agent(cluster, i: int, cwd: Path, args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "scaletrain.cli.main", "train", *JOB, *args, "--nproc-per-node", "2"]
    cmd += ["--node-rank", str(i), "--rdzv-endpoint", ENDPOINT]
    return cluster.nodes[i].popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _start(cluster, cwd: Path, args: list[str], per_node: dict[int, list[str]] | None = None):
    return [_agent(cluster, i, cwd, [*args, *(per_node or {}).get(i, [])]) for i in range(len(cluster.nodes))]


def _finish(procs, timeout: float = 600) -> list[tuple[int, str]]:
    out = []
    for p in procs:
        _, err = p.communicate(timeout=timeout)
        out.append((p.returncode, err))
    return out


def _wait_for_checkpoint(run: Path, step: int, procs, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run / "checkpoints" / f"step_{step:08d}").is_dir():
            return
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a node ended before checkpoint {step}: {[p.returncode for p in procs]}")
        time.sleep(0.05)
    raise AssertionError(f"checkpoint {step} not written in {timeout} s")


def _final_weights(run: Path) -> dict:
    return load_full_model_state(run / "checkpoints" / f"step_{STEPS:08d}")[0]


LAYOUTS = {
    "fsdp": [],  # FSDP2 over the 4 ranks of both nodes
    "ddp": ["parallel.dp_replicate=4"],
    "hsdp": ["parallel.dp_replicate=2", "parallel.dp_shard=2"],  # shard inside a node, replicate across
    "pp_tp": ["parallel.pp=2", "parallel.tp=2"],  # TP inside a node, pipeline stages across nodes
}


@pytest.fixture(scope="module")
def layouts(cluster, work):
    """name -> run folder of that layout across both nodes, each run once on first use (shared by the tests)."""
    runs: dict[str, Path] = {}

    def run(name: str) -> Path:
        if name not in runs:
            results = _finish(_start(cluster, work, [f"run.name={name}", *LAYOUTS[name], "--nnodes", "2"]))
            for node, (rc, err) in enumerate(results):
                assert rc == 0, f"{name} node {node} exited {rc}: {err[-3000:]}"
            runs[name] = work / "runs" / name
        return runs[name]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_across_nodes_matches_one_process(layouts, work, layout):
    ref, got = losses(work / "runs/single"), losses(layouts(layout))
    assert len(ref) == len(got) == STEPS
    for step, (a, b) in enumerate(zip(ref, got), 1):
        assert abs(a - b) <= TOL, f"{layout} step {step}: {b} vs single-process {a}"
    assert json.loads((layouts(layout) / "summary.json").read_text())["world_size"] == 4


@pytest.mark.slow
def test_node_with_another_config_is_refused(cluster, work):
    results = _finish(_start(cluster, work, ["run.name=mismatch", "--nnodes", "2"], {1: ["train.lr=0.002"]}))
    want = (
        "scaletrain: error: node 1 (198.51.100.2) has a different job config than node 0 (198.51.100.1): "
        "train.lr=0.002 vs 0.003; start every node with the same config and overrides"
    )
    for node, (rc, err) in enumerate(results):
        assert rc == 2, f"node {node} exited {rc}: {err[-3000:]}"
        assert err.strip().splitlines()[-1] == want, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
    assert not (work / "runs/mismatch/metrics.jsonl").exists()


def test_two_nodes_claiming_one_node_rank_are_refused():
    fp = {"addr": "198.51.100.1", "node_rank": 1, "group_rank": 0, "config_sha256": "x", "config": {}}
    fp |= {"scaletrain": "1", "torch": "2", "python": "3"}
    other = {**fp, "addr": "198.51.100.2", "group_rank": 1}
    assert compare([fp, other]) == (
        "launch.node_rank: 1 is given by two nodes (198.51.100.1 and 198.51.100.2); give each node its own --node-rank"
    )
    assert compare([fp, {**other, "node_rank": 0, "torch": "2.99"}]) == (
        "node 0 (198.51.100.2) runs torch 2.99 but node 1 (198.51.100.1) runs 2; install the same torch on every node"
    )


@pytest.mark.slow
def test_killed_node_comes_back_and_the_run_finishes_bit_identical(cluster, work, layouts):
    run = work / "runs/nodefail"
    args = ["run.name=nodefail", "launch.max_restarts=2", "--nnodes", "2"]
    procs = _start(cluster, work, args)
    _wait_for_checkpoint(run, 2, procs)
    assert cluster.nodes[1].kill()  # the agent and both ranks of node 1
    procs[1].wait(timeout=60)
    procs[1] = _agent(cluster, 1, work, args)  # the node is back: the same command again
    results = _finish(procs)
    for node, (rc, err) in enumerate(results):
        assert rc == 0, f"node {node} exited {rc}: {err[-3000:]}"
    assert "resumed from" in results[0][1], results[0][1][-3000:]
    got, want = _final_weights(run), _final_weights(layouts("fsdp"))
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert losses(run) == losses(layouts("fsdp"))


@pytest.mark.slow
def test_killed_node_elastic_run_shrinks_and_finishes(cluster, work, layouts):
    run = work / "runs/shrink"
    procs = _start(cluster, work, ["run.name=shrink", "launch.max_restarts=1", "--nnodes", "1:2"])
    _wait_for_checkpoint(run, 2, procs)
    assert cluster.nodes[1].kill()
    procs[1].wait(timeout=60)
    ((rc, err),) = _finish(procs[:1])
    assert rc == 0, err[-3000:]
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2  # node 0's 2 ranks went on alone
    ref, got = losses(layouts("fsdp")), losses(run)
    assert len(got) == STEPS
    for step, (a, b) in enumerate(zip(ref, got), 1):
        assert abs(a - b) <= TOL, f"step {step}: {b} after shrinking vs {a}"
    assert max(r["step"] for r in read_jsonl(run / "metrics.jsonl")) == STEPS
