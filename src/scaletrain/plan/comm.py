"""Collective cost over the links a mesh dim crosses.

Ranks are numbered node by node and the mesh is laid out outermost to innermost as pp, dp_replicate, dp_shard,
cp, tp (torchtitan's order; scaletrain.parallel.dims.MESH_ORDER): tensor parallelism gets the fastest neighbours,
pipeline and data parallelism cross nodes first.

Ring algorithms (formulas.md): all-reduce moves 2(n-1)/n·S per rank, reduce-scatter and all-gather (n-1)/n·S.
A group with k ranks in each of N nodes is costed hierarchically, as NCCL achieves on rail-optimised fabrics:
its intra-node share over the node's link, its inter-node share over the k NIC ports its ranks own.
Where `scaletrain bench --nodes` measured a ring across nodes (Cluster.measured_inter_collectives), a group that
spans nodes is priced as that flat ring instead (ring_across_nodes_seconds): gloo runs no hierarchical algorithm.
"""

from __future__ import annotations

import numpy as np

from scaletrain.hardware.cluster import Cluster


def group_placement(size, inner, gpus_per_node: int):
    """(ranks per node, nodes) of a mesh-dim group of `size` ranks whose members are `inner` ranks apart."""
    size = np.asarray(size, dtype=np.float64)
    inner = np.asarray(inner, dtype=np.float64)
    per_node = np.where(inner >= gpus_per_node, 1.0, np.minimum(size, np.maximum(1.0, gpus_per_node // inner)))
    return per_node, size / per_node


def collective_seconds(kind: str, nbytes, size, inner, cluster: Cluster):
    """Seconds one collective of `nbytes` (per rank, the full unsharded message) takes on a group of `size` ranks
    spaced `inner` apart. kind: all_reduce, reduce_scatter or all_gather."""
    factor = 2.0 if kind == "all_reduce" else 1.0
    if kind not in ("all_reduce", "reduce_scatter", "all_gather"):
        raise ValueError(f"unknown collective {kind!r}")
    nbytes = np.asarray(nbytes, dtype=np.float64)
    k, nodes = group_placement(size, inner, cluster.gpus_per_node)
    intra_latency, intra_bw = cluster.intra_collective(kind)  # measured by `scaletrain bench`, else the link's
    intra = factor * (k - 1) / k * nbytes / intra_bw
    inter = np.where(nodes > 1, factor * (nodes - 1) / nodes * nbytes / (k * cluster.inter_bw_per_gpu), 0.0)
    latency = factor * ((k - 1) * intra_latency + (nodes - 1) * cluster.inter_link.latency_s)
    seconds = intra + inter + latency
    if cluster.inter_collective(kind) is not None:
        seconds = np.where(nodes > 1, ring_across_nodes_seconds(kind, nbytes, size, k, cluster), seconds)
    return np.where(np.asarray(size) > 1, seconds, 0.0)


def ring_across_nodes_seconds(kind: str, nbytes, size, per_node, cluster: Cluster):
    """Seconds of one ring collective of `nbytes` (per rank, the full message) over `size` ranks, `per_node` of
    them in each node, priced with the ring across nodes `scaletrain bench --nodes` measured (a flat ring, as gloo
    runs it: every node's link carries one stream of each group). That ring held every rank of a node, so its bus
    bandwidth is what one stream gets of the link; the gpus_per_node / per_node groups of a mesh dim that run at
    once share it (HSDP's replicate groups, one rank per node: each gets 1/gpus_per_node of it), and a ring runs
    at its slowest edge, so never faster than inside a node. Every step pays the measured latency per ring step."""
    factor = 2.0 if kind == "all_reduce" else 1.0
    measured = cluster.inter_collective(kind)
    if measured is None:
        raise ValueError(f"no inter-node figures measured for {kind}; run `scaletrain bench --nodes N`")
    latency, busbw = measured
    n, k = np.asarray(size, dtype=np.float64), np.asarray(per_node, dtype=np.float64)
    bw = busbw * k / cluster.gpus_per_node
    bw = np.where(k > 1, np.minimum(bw, cluster.intra_collective(kind)[1]), bw)
    return factor * (n - 1) / n * np.asarray(nbytes, dtype=np.float64) / bw + factor * (n - 1) * latency


def p2p_seconds(nbytes, inner, size, cluster: Cluster):
    """Seconds to send `nbytes` to the neighbouring pipeline stage (members `inner` ranks apart)."""
    nbytes = np.asarray(nbytes, dtype=np.float64)
    crosses = np.asarray(inner) * np.asarray(size) > cluster.gpus_per_node
    bw = np.where(crosses, cluster.inter_bw_per_gpu, cluster.intra_bw)
    lat = np.where(crosses, cluster.inter_link.latency_s, cluster.intra_link.latency_s)
    return nbytes / bw + lat


def crosses_nodes(size, inner, gpus_per_node: int):
    """True where a mesh-dim group spans more than one node."""
    return group_placement(size, inner, gpus_per_node)[1] > 1
