"""Bus bandwidth between nodes, for `scaletrain bench --nodes N` (its agents: launch/bench_nodes.py).

Every node first runs the local bench (hardware/bench.py: compute curves and collectives between its own ranks over
127.0.0.1) at the same time as the others (started together after a barrier: simulated nodes share one machine's
cores, and the compute is meant to be measured while every node's ranks run). Then the ranks of all nodes (--nproc
per node, numbered node by node as in training) time all-reduce, all-gather and reduce-scatter over the whole world
at several message sizes (measure_world_collectives), fitted to latency + bandwidth (fit_seconds), then the same
inside each node with every node at it at once; those replace the local bench's figures inside a node. A ring over
ranks numbered node by node crosses each node's link once, so its bus bandwidth is what one stream of a collective
gets between nodes (or the intra-node rate, if that is slower). Node 0 writes the calibration with both sets of
figures.
"""

from __future__ import annotations

import os
from functools import partial

import numpy as np
import torch

from scaletrain.hardware.fit import fit_latency_bandwidth, ring_terms, sync_extras
from scaletrain.hardware.kernels import COLLECTIVES, KIB, MIB, collective_functions
from scaletrain.hardware.timing import median_seconds, sync_extra_seconds

INTERNODE_BYTES = (64 * KIB, 1 * MIB, 4 * MIB, 16 * MIB)  # up to the --size-mb message
SAMPLES = 5
STORE_TIMEOUT_S = 300.0  # how long a node waits for the others to come up


class NodeBenchError(ValueError):
    """The nodes of one `bench --nodes` disagree (another --nproc, --size-mb or torch); one line."""


def message_sizes(max_bytes: int) -> tuple[int, ...]:
    """Message sizes measured across nodes: INTERNODE_BYTES below `max_bytes`, and `max_bytes` itself."""
    return tuple(sorted({b for b in INTERNODE_BYTES if b < max_bytes} | {max_bytes}))


def measure_world_collectives(
    sizes: tuple[int, ...], device_type: str = "cpu", amid: bool = True
) -> dict[str, list[tuple[int, float]]]:
    """One rank under the torchrun agent: all-reduce, all-gather and reduce-scatter over every rank of every node
    at each of `sizes` bytes; (bytes, seconds of the slowest rank) per kind, the same on every rank. The
    all-gather's bytes are its gathered output and the reduce-scatter's its full input, as in bench.py. On CPUs
    also "sync": what an all-gather over every rank costs after compute on every rank (timing.py's
    sync_extra_seconds, over the nodes), as rank 0 measured it.

    Then the same inside each node ("node_" + kind, "node_sync"; more than one rank per node), every node at
    once, as training runs them: the local bench measured them while the other nodes were at other work, or done
    (simulated nodes share one machine's cores, and a node alone on them waits less on its own collectives).
    amid=False leaves out the waits amid compute (doctor reports bandwidths only)."""
    import torch.distributed as dist

    from scaletrain.parallel.runtime import init_distributed, shutdown_distributed

    rt = init_distributed(device_type, timeout_s=STORE_TIMEOUT_S)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    out: dict[str, list] = {}
    try:
        out |= _time_collectives(sizes, rt.world_size, None, rt.device, amid)
        if per_node > 1:
            node, _ = dist.new_subgroups(group_size=per_node)  # ranks are numbered node by node, as in training
            out |= {f"node_{k}": v for k, v in _time_collectives(sizes, per_node, node, rt.device, amid).items()}
    finally:
        shutdown_distributed()
    return out


def _time_collectives(sizes: tuple[int, ...], size: int, group, device, amid: bool) -> dict[str, list]:
    """Every kind at every message size over `group` (None: the world) of `size` ranks, and on CPUs the wait of
    an all-gather amid compute; every rank of the world takes part (a world barrier before each, the slowest
    rank's seconds)."""
    import torch.distributed as dist

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)  # NCCL collectives return early
    gather, scatter = collective_functions()
    gather, scatter = partial(gather, group=group), partial(scatter, group=group)
    out: dict[str, list] = {"all_reduce": [], "all_gather": [], "reduce_scatter": []}
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        part = t[: nbytes // 4 // size]
        gathered = torch.empty(size * part.numel(), dtype=torch.float32, device=device)
        for kind, fn, nbytes_of in (
            ("all_reduce", partial(dist.all_reduce, t, group=group), nbytes),
            ("all_gather", partial(gather, gathered, part), gathered.numel() * 4),
            ("reduce_scatter", partial(scatter, torch.empty_like(part), gathered), gathered.numel() * 4),
        ):
            dist.barrier()
            inner = min(5, max(1, MIB // nbytes))  # the same count on every rank
            slowest = torch.tensor([median_seconds(fn, sync, inner, SAMPLES)], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a collective ends with its slowest rank
            out[kind].append((nbytes_of, float(slowest.cpu())))
    if amid and device.type == "cpu":  # ranks sharing cores (docs/planner.md): a collective amid compute
        points = torch.tensor(sync_extra_seconds(size, dist.barrier, gather), dtype=torch.float64)
        dist.broadcast(points, 0)  # rank 0's, on every rank (the agent returns any rank's)
        out["sync"] = [(float(g), float(c)) for g, c in points]
    return out


def fit_seconds(points, steps: float, volume: float) -> tuple[float, float]:
    """(latency per ring step in s, bus bandwidth in bytes/s) of t = steps x latency + volume x bytes / busbw, least
    squares on the seconds themselves: across a slow link the large messages carry the bandwidth, and on a loaded
    host the small ones' few milliseconds are mostly noise (fit.py's relative-error fit let one noisy 64 KiB point
    pull a 1 Gbit/s link's busbw 30 % high). A negative latency (noise) falls back to a bandwidth-only fit."""
    size = np.asarray([p[0] for p in points], dtype=np.float64)
    sec = np.asarray([p[1] for p in points], dtype=np.float64)
    (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(size), size], axis=1), sec, rcond=None)
    if a < 0 or b <= 0:
        a, b = 0.0, float(np.sum(size * sec) / np.sum(size * size))
    return float(a) / steps, volume / float(b)


def internode_fields(points: dict[str, list], nodes: int, per_node: int) -> dict:
    """Calibration fields of the world collectives measured over `nodes` x `per_node` ranks; the wait of one amid
    compute is its cost beyond what the all-gather fit charges for SYNC_BYTES (as bench.py's calibration_from)."""
    n = nodes * per_node
    ar_lat, ar_bw = fit_seconds(points["all_reduce"], *ring_terms("all_reduce", n))
    ag_lat, ag_bw = fit_seconds(points["all_gather"], *ring_terms("all_gather", n))
    # files and callers from before the reduce-scatter was measured: the planner then takes it as an all-gather
    rs = (
        fit_seconds(points["reduce_scatter"], *ring_terms("reduce_scatter", n))
        if points.get("reduce_scatter")
        else (None, None)
    )
    return {
        "nodes": nodes,
        "internode_allreduce_busbw": ar_bw,
        "internode_allreduce_latency_s": ar_lat,
        "internode_allgather_busbw": ag_bw,
        "internode_allgather_latency_s": ag_lat,
        "internode_reducescatter_busbw": rs[1],
        "internode_reducescatter_latency_s": rs[0],
        "internode_all_reduce": tuple(points["all_reduce"]),
        "internode_all_gather": tuple(points["all_gather"]),
        "internode_reduce_scatter": tuple(points.get("reduce_scatter", ())),
        "internode_collective_amid_compute": sync_extras(points.get("sync", ()), (ag_lat, ag_bw), n),
    } | _node_fields(points, per_node)


def _node_fields(points: dict[str, list], per_node: int) -> dict:
    """The figures inside a node measured with every node at work (measure_world_collectives' "node_" points),
    fitted as bench.py fits its own: they replace the local bench's. None measured (one rank per node): none."""
    if not points.get("node_all_reduce"):
        return {}
    fits = {kind: fit_latency_bandwidth(points[f"node_{kind}"], *ring_terms(kind, per_node)) for kind in COLLECTIVES}
    return {
        **{f"{kind.replace('_', '')}_{f}": fits[kind][i] for kind in fits for i, f in ((1, "busbw"), (0, "latency_s"))},
        **{kind: tuple(points[f"node_{kind}"]) for kind in fits},
        "collective_amid_compute": sync_extras(points.get("node_sync", ()), fits["all_gather"], per_node),
    }


def compare_nodes(records: list[dict | None], nodes: int) -> str | None:
    """One line naming the first node whose bench differs from node 0's (or a node rank nobody gave); None if all
    agree. `records[i]`: what node i published, None if no node gave --node-rank i."""
    missing = [i for i, r in enumerate(records) if r is None]
    if missing:
        return (
            f"--node-rank: no node gave {missing[0]} (two nodes gave the same one?); give each of the {nodes} "
            f"nodes its own --node-rank 0..{nodes - 1}"
        )
    first = records[0]
    assert first is not None
    what = {"nproc": "--nproc", "sizes": "--size-mb (message sizes)", "torch": "torch", "scaletrain": "scaletrain"}
    for r in records[1:]:
        assert r is not None
        for key, name in what.items():
            if r[key] != first[key]:
                return (
                    f"node {r['node']} ({r['addr']}) has {name} {r[key]} but node 0 ({first['addr']}) has "
                    f"{first[key]}; start every node with the same `scaletrain bench --nodes` command and versions"
                )
    return None
