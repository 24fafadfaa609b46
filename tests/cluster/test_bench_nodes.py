"""`scaletrain bench --nodes 2` across two simulated nodes (network namespaces, 2 CPU ranks each, link shaped to
1 Gbit/s by `tc tbf`): node 0 writes a calibration whose inter-node bus bandwidth shows the shaping, well below the
figure measured inside a node (loopback, unshaped), and the planner prices collectives spanning nodes with it."""

import subprocess
import sys

import pytest

from cluster_nodes import make_cluster
from scaletrain.hardware import apply_calibration, load_calibration, make_cluster as make_plan_cluster
from scaletrain.plan.comm import collective_seconds

ENDPOINT = "198.51.100.1:29410"
LINE_RATE = 1e9 / 8  # bytes/s of tbf's 1gbit


@pytest.fixture(scope="module")
def cluster():
    yield from make_cluster(2, rate="1gbit")


@pytest.mark.slow
def test_bench_across_nodes_measures_the_shaped_link(cluster, tmp_path):
    out = tmp_path / "cal.toml"
    args = ["--nproc", "2", "--size-mb", "4", "--matmul-n", "64", "-o", str(out)]
    procs = [
        node.popen(
            [sys.executable, "-m", "scaletrain.cli.main", "bench", "--nodes", "2", "--node-rank", str(node.index)]
            + ["--rdzv-endpoint", ENDPOINT, *args],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in cluster.nodes
    ]
    results = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    for i, (_, stderr, rc) in enumerate(results):
        assert rc == 0, f"node {i} exited {rc}: {stderr[-3000:]}"
        assert "Traceback" not in stderr, stderr[-3000:]
    assert "across 2 nodes all-reduce busbw" in results[0][0] and "(across the nodes +" in results[0][0], results[0][0]
    assert results[1][0].strip() == f"node 1: measured; node 0 writes {out}"
    cal = load_calibration(out)
    assert cal.nodes == 2 and cal.ranks == 2
    assert [p[0] for p in cal.internode_all_reduce] == [2**16, 2**20, 2**22]
    # CPU ranks: the wait of an all-gather over every rank of both nodes after compute, at each measured gap
    assert len(cal.internode_collective_amid_compute) == len(cal.collective_amid_compute) == 4
    inter, intra = cal.internode_allreduce_busbw, cal.allreduce_busbw
    assert inter is not None and intra is not None and cal.internode_allgather_busbw is not None
    # one ring stream per node link: about the line rate, far below an unshaped veth's (8x and more). Not exactly
    # it: tbf lets each collective start with its 256 KB burst, so the fit over 64 KB-4 MB runs above the line
    # rate, 1.12-1.15x with no noise at all at the 1-3 ms latencies measured here (worked through with
    # hardware/fit.py), and 1.22x was seen with the other test worker busy: 1.3x
    bound = 1.3 * LINE_RATE
    assert inter < bound, f"inter-node busbw {inter / 1e9:.3f} GB/s on a 1 Gbit/s link"
    assert cal.internode_allgather_busbw < bound
    assert len(cal.internode_reduce_scatter) == 3 and cal.internode_reducescatter_busbw is not None
    assert cal.internode_reducescatter_busbw < bound
    # the shaped link is the slower one (by 10x and more on a quiet host; inside a node, loopback between processes
    # that share 2 cores with whatever else runs: 0.24 GB/s was seen under a load of 18, so no tighter factor)
    assert inter < intra, f"inter-node {inter / 1e9:.3f} GB/s vs inside a node {intra / 1e9:.3f} GB/s"
    # the planner prices DDP's ring over both nodes with it, HSDP's shard groups inside a node without it
    plan = apply_calibration(make_plan_cluster("cpu", 4, gpus_per_node=2), cal)
    S = 16e6
    assert collective_seconds("all_reduce", S, 4, 1, plan) >= 1.5 * S / inter
    assert collective_seconds("all_reduce", S, 2, 1, plan) < 1.5 * S / inter


def _doctor(cluster, tmp_path, port: int, nproc: list[int]) -> list[tuple[str, str, int]]:
    procs = [
        node.popen(
            [sys.executable, "-m", "scaletrain.cli.main", "doctor", "--no-bandwidth", "--json", "--nodes", "2"]
            + ["--node-rank", str(node.index), "--rdzv-endpoint", f"198.51.100.1:{port}", "--nproc", str(nproc[i])],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, node in enumerate(cluster.nodes)
    ]
    return [p.communicate(timeout=300) + (p.returncode,) for p in procs]


@pytest.mark.slow
def test_doctor_across_nodes_checks_they_agree_and_measures_the_link(cluster, tmp_path):
    import json

    for out, err, rc in _doctor(cluster, tmp_path, 29411, [2, 2]):
        assert "Traceback" not in err, err[-3000:]
        rows = {r["name"]: r for r in json.loads(out)}
        assert rc == 0, [r for r in rows.values() if r["status"] == "fail"]
        assert rows["nodes agree"]["status"] == "pass", rows["nodes agree"]
        inter = rows["inter-node bus bandwidth"]["detail"]
        assert "over 2 x 2 ranks" in inter and "reduce-scatter" in inter
        # the all-reduce across the shaped link: at most its line rate (tbf's burst and noise: 1.2x)
        busbw = float(inter.split("all-reduce ")[1].split(" GB/s")[0]) * 1e9
        assert 0 < busbw < 1.2 * LINE_RATE
        assert "every node at once" in rows["intra-node bus bandwidth"]["detail"]
    # nodes that disagree (another --nproc) are told which and how, in one line; nothing is measured
    results = _doctor(cluster, tmp_path, 29412, [2, 3])
    for out, err, rc in results:
        assert "Traceback" not in err, err[-3000:]
        rows = {r["name"]: r for r in json.loads(out)}
        assert rc == 1 and rows["nodes agree"]["status"] == "fail" and "inter-node bus bandwidth" not in rows
        assert "node 1 (198.51.100.2) has --nproc 3 but node 0" in rows["nodes agree"]["detail"]
