"""Inter-node figures of `scaletrain bench --nodes` in the planner (pure computation on synthetic calibrations, no
timing): they round-trip through the file, collectives whose group spans nodes are priced as the measured ring
(DDP/FSDP over 2 nodes x 2 ranks limited by the link, HSDP's replicate groups sharing it, its shard groups at the
intra-node rate), and the planner's ranking of DDP vs HSDP follows the link."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import run_cli_in_process
from scaletrain.hardware import Calibration, apply_calibration, load_calibration, make_cluster
from scaletrain.hardware.calibration import CalibrationError, save_calibration
from scaletrain.hardware.internode import compare_nodes, fit_seconds, internode_fields, message_sizes
from scaletrain.models import preset_spec
from scaletrain.plan import Layout, Workload, evaluate_layout
from scaletrain.plan.comm import collective_seconds

INTRA_AR, INTRA_AG = 0.6e9, 0.5e9  # bytes/s inside a node
LAT = 1e-3  # s per ring step across nodes


def calibration(inter_bw: float) -> Calibration:
    """2 CPU ranks per node on 2 nodes; inside a node all-reduce 0.6 GB/s + 100 us per ring step, all-gather
    0.5 GB/s + 50 us; across nodes both at `inter_bw` + 1 ms per ring step."""
    pts = tuple((b, 6 * LAT + 1.5 * b / inter_bw) for b in (2.0**16, 2.0**20, 2.0**24))
    fields = internode_fields({"all_reduce": list(pts), "all_gather": [(b, t / 2) for b, t in pts]}, 2, 2)
    return Calibration(
        "cpu", "box", 2, 40e9, "float32", 5e9, INTRA_AR, None, "2.13.0", 20e-6,
        allreduce_latency_s=100e-6, allgather_busbw=INTRA_AG, allgather_latency_s=50e-6, **fields,
    )  # fmt: skip


def cluster_of(cal: Calibration):
    return apply_calibration(make_cluster("cpu", 4, gpus_per_node=2), cal)


def test_internode_fields_fit_the_ring_and_round_trip(tmp_path):
    cal = calibration(0.12e9)
    assert cal.nodes == 2
    assert cal.internode_allreduce_busbw == pytest.approx(0.12e9)
    assert cal.internode_allreduce_latency_s == pytest.approx(LAT)
    # all-gather: half the all-reduce's seconds over half its ring steps and volume: the same figures
    assert cal.internode_allgather_busbw == pytest.approx(0.12e9)
    assert cal.internode_allgather_latency_s == pytest.approx(LAT)
    path = tmp_path / "cal.toml"
    save_calibration(cal, path)
    assert "\ninternode_all_reduce = [" in path.read_text()
    assert load_calibration(path) == cal
    path.write_text(path.read_text().replace("internode_allreduce_busbw = ", "internode_allreduce_busbw = -"))
    with pytest.raises(CalibrationError, match=r"internode_allreduce_busbw: must be a positive number"):
        load_calibration(path)
    # the absolute-seconds fit: one noisy small message does not move a slow link's bandwidth much
    pts = [(2**16, 0.018), (2**20, 6e-3 + 1.5 * 2**20 / 0.125e9), (2**22, 6e-3 + 1.5 * 2**22 / 0.125e9)]
    pts.append((2**24, 6e-3 + 1.5 * 2**24 / 0.125e9))
    assert fit_seconds(pts, 6, 1.5)[1] == pytest.approx(0.125e9, rel=0.05)
    assert message_sizes(2**22) == (2**16, 2**20, 2**22)


def test_collectives_spanning_nodes_are_priced_at_the_measured_inter_node_ring():
    B, S = 0.12e9, 24e6
    cluster = cluster_of(calibration(B))
    # DDP / FSDP over all 4 ranks: one flat ring, each node's link carries one stream of it
    assert collective_seconds("all_reduce", S, 4, 1, cluster) == pytest.approx(2 * 3 / 4 * S / B + 2 * 3 * LAT)
    assert collective_seconds("all_gather", S, 4, 1, cluster) == pytest.approx(3 / 4 * S / B + 3 * LAT)
    assert collective_seconds("reduce_scatter", S, 4, 1, cluster) == collective_seconds("all_gather", S, 4, 1, cluster)
    # a measured reduce-scatter (gloo's: at about an all-reduce's cost) is priced with its own fit
    pts = [(b, 3 * LAT + 3 / 4 * b / (B / 2)) for b in (2.0**16, 2.0**20, 2.0**24)]
    ar, ag = [(b, 6 * LAT + 1.5 * b / B) for b, _ in pts], [(b, 3 * LAT + 0.75 * b / B) for b, _ in pts]
    fields = internode_fields({"all_reduce": ar, "all_gather": ag, "reduce_scatter": pts}, 2, 2)
    assert fields["internode_reducescatter_busbw"] == pytest.approx(B / 2)
    scatter = cluster_of(dataclasses.replace(calibration(B), **fields))
    assert collective_seconds("reduce_scatter", S, 4, 1, scatter) == pytest.approx(3 / 4 * S / (B / 2) + 3 * LAT)
    assert collective_seconds("all_gather", S, 4, 1, scatter) == collective_seconds("all_gather", S, 4, 1, cluster)
    # HSDP 2x2: the replicate groups (one rank per node, 2 ranks apart) run at once and share each node's link
    assert collective_seconds("all_reduce", S, 2, 2, cluster) == pytest.approx(2 * 1 / 2 * S / (B / 2) + 2 * LAT)
    # ... its shard groups stay inside a node, at the intra-node figures
    assert collective_seconds("all_gather", S, 2, 1, cluster) == pytest.approx(1 / 2 * S / INTRA_AG + 50e-6)
    # a link faster than a node's loopback: the ring runs at its slowest edge, inside the node
    fast = cluster_of(calibration(10e9))
    assert collective_seconds("all_reduce", S, 4, 1, fast) == pytest.approx(2 * 3 / 4 * S / INTRA_AR + 2 * 3 * LAT)
    # pipeline stages across nodes: every rank of a node sends through the one link
    assert fast.inter_bw_per_gpu == pytest.approx(10e9 / 2)
    # without inter-node figures the datasheet's hierarchical model is kept
    plain = cluster_of(
        dataclasses.replace(calibration(B), internode_allreduce_busbw=None, internode_allgather_busbw=None)
    )
    assert plain.measured_inter_collectives is None
    assert collective_seconds("all_reduce", S, 4, 1, plain) != collective_seconds("all_reduce", S, 4, 1, cluster)


def test_the_planner_ranks_hsdp_first_on_a_slow_link_and_ddp_on_a_fast_one():
    work = Workload("small", preset_spec("small").shape(), 64, 8)
    ddp = Layout(4, 1, 1, 1, 1, 2, 1, "none", "fp32", "none")
    hsdp = Layout(2, 2, 1, 1, 1, 2, 1, "none", "fp32", "none")
    fsdp = Layout(1, 4, 1, 1, 1, 2, 1, "none", "fp32", "none")

    def steps(inter_bw: float) -> dict[str, float]:
        cluster = cluster_of(calibration(inter_bw))
        return {
            n: float(evaluate_layout(work, cluster, x).step_s)
            for n, x in (("ddp", ddp), ("hsdp", hsdp), ("fsdp", fsdp))
        }

    slow, fast = steps(0.03e9), steps(0.5e9)
    assert min(slow, key=slow.__getitem__) == "hsdp"
    assert min(fast, key=fast.__getitem__) == "ddp"
    # a 4x slower link costs DDP about its gradient all-reduce (fp32, 2 x 3/4 of the parameters' bytes) 4x
    grad_bytes = 4.0 * preset_spec("small").num_params()
    ar = lambda bw: 2 * 3 / 4 * grad_bytes / bw  # noqa: E731
    assert slow["ddp"] - steps(0.12e9)["ddp"] == pytest.approx(ar(0.03e9) - ar(0.12e9), rel=0.05)


def test_nodes_that_disagree_are_named_in_one_line():
    rec = {"node": 0, "addr": "198.51.100.1", "nproc": 2, "sizes": [65536], "torch": "2.13.0", "scaletrain": "0.1"}
    other = {**rec, "node": 1, "addr": "198.51.100.2"}
    assert compare_nodes([rec, other], 2) is None
    assert compare_nodes([rec, {**other, "nproc": 4}], 2) == (
        "node 1 (198.51.100.2) has --nproc 4 but node 0 (198.51.100.1) has 2; start every node with the same "
        "`scaletrain bench --nodes` command and versions"
    )
    assert compare_nodes([rec, None], 2) == (
        "--node-rank: no node gave 1 (two nodes gave the same one?); give each of the 2 nodes its own --node-rank 0..1"
    )


@pytest.mark.parametrize(
    "args, line",
    [
        (["--nodes", "2"], "--nodes 2: also give --node-rank 0..1 and --rdzv-endpoint HOST:PORT on every node"),
        (
            ["--nodes", "2", "--node-rank", "2", "--rdzv-endpoint", "198.51.100.1:29400"],
            "--node-rank: 2 is not below --nodes 2; number the nodes 0..1",
        ),
        (
            ["--node-rank", "0"],
            "--node-rank/--rdzv-endpoint: only with --nodes N (N >= 2); drop them for a one-node bench",
        ),
        (
            ["--nodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:29400"],
            "--rdzv-endpoint: '127.0.0.1' is 127.0.0.1 on this host, a loopback address the other nodes cannot "
            "reach; name the rendezvous host by the address they use",
        ),
    ],
)
def test_bench_nodes_flags_that_do_not_go_together_are_one_line(tmp_path, args, line):
    proc = run_cli_in_process(["bench", *args, "-o", str(tmp_path / "cal.toml")], tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == f"scaletrain: error: {line}"
    assert not (tmp_path / "cal.toml").exists()


def test_a_group_spanning_nodes_waits_what_bench_measured_across_them():
    """CPU ranks: bench --nodes measures the wait of an all-gather over every rank of every node after compute
    (its cost beyond the all-gather fit for 64 KiB); a collective whose group spans nodes pays it, a group inside a
    node the intra-node curve."""
    from scaletrain.hardware.timing import SYNC_BYTES
    from scaletrain.plan.efficiency import amid_compute_seconds

    B = 0.12e9
    base = calibration(B)
    ag_alone = 3 * LAT + 3 / 4 * SYNC_BYTES / B  # the world all-gather fit's 64 KiB
    pts = tuple((b, 6 * LAT + 1.5 * b / B) for b in (2.0**16, 2.0**20, 2.0**24))
    raw = {
        "all_reduce": list(pts),
        "all_gather": [(b, t / 2) for b, t in pts],
        "sync": [(0.001, ag_alone + 0.004), (0.1, ag_alone + 0.02)],
    }
    fields = internode_fields(raw, 2, 2)
    waits = fields["internode_collective_amid_compute"]
    assert [g for g, _ in waits] == [0.001, 0.1] and [x for _, x in waits] == pytest.approx([0.004, 0.02])
    cal = dataclasses.replace(base, host_cores=2, collective_amid_compute=((0.001, 0.001), (0.1, 0.001)), **fields)
    c = cluster_of(cal)
    assert c.measured_inter_sync_curve == waits
    assert amid_compute_seconds(0.1, 4, c, True) == pytest.approx(0.02)
    assert amid_compute_seconds(0.1, 2, c, False) == pytest.approx(0.001)
    # in the step: DDP over 2 x 2 (one bucket) spans nodes; HSDP's shard groups do not, its replicas do
    without = cluster_of(dataclasses.replace(cal, internode_collective_amid_compute=()))
    work = Workload("tiny", preset_spec("tiny").shape(), 256, 16)
    ddp, hsdp = (
        Layout(4, 1, 1, 1, 1, 4, 1, "none", "fp32", "none"),
        Layout(2, 2, 1, 1, 1, 4, 1, "none", "fp32", "none"),
    )
    extra = {
        name: evaluate_layout(work, c, lay).time["dp comm exposed"]
        - evaluate_layout(work, without, lay).time["dp comm exposed"]
        for name, lay in (("ddp", ddp), ("hsdp", hsdp))
    }
    # DDP: one bucket; HSDP: 5 units' all-reduces across the replicas (the gap, half a block's backward, is on the
    # curve's rising part), each the inter-node wait less the intra-node one
    assert extra["ddp"] > 0 and extra["hsdp"] > extra["ddp"]
    # a one-node calibration has none: nothing changes
    path_free = dataclasses.replace(cal, internode_collective_amid_compute=())
    assert cluster_of(path_free).measured_inter_sync_curve is None
