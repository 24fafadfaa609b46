"""Collective cost over the links a mesh dim crosses.

Ranks are numbered node by node and the mesh is laid out outermost to innermost as pp, dp_replicate, dp_shard,
cp, tp (torchtitan's order; scaletrain.parallel.dims.MESH_ORDER): tensor parallelism gets the fastest neighbours,
pipeline and data parallelism cross nodes first.

Ring algorithms (formulas.md): all-reduce moves 2(n-1)/n·S per rank, reduce-scatter and all-gather (n-1)/n·S.
A group with k ranks in each of N nodes is costed hierarchically, as NCCL achieves on rail-optimised fabrics:
its intra-node share over the node's link, its inter-node share over the k NIC ports its ranks own.
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
    return np.where(np.asarray(size) > 1, intra + inter + latency, 0.0)


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
