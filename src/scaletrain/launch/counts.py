"""The node and rank counts every cluster launcher takes (--nodes, --gpus-per-node, --nproc-per-node), checked
one way for all of them."""

from __future__ import annotations


def check_rank_counts(
    nodes: int, gpus_per_node: int, nproc_per_node: int, unit: str = "node", error: type[ValueError] = ValueError
) -> None:
    """Raise `error` with one line naming the option when the counts cannot describe a job; `unit` is what
    holds a node's GPUs in the launcher's words (a Slurm node, a Kubernetes pod)."""
    if nodes < 1:
        raise error(f"--nodes: must be at least 1 (got {nodes})")
    if gpus_per_node < 0:
        raise error(f"--gpus-per-node: must be 0 (CPU ranks) or more (got {gpus_per_node})")
    if nproc_per_node < 0:
        raise error(f"--nproc-per-node: must be at least 1, or 0 for one rank per GPU (got {nproc_per_node})")
    if gpus_per_node and nproc_per_node > gpus_per_node:
        raise error(
            f"--nproc-per-node: {nproc_per_node} ranks on {gpus_per_node} GPUs per {unit}; use at most one rank per GPU"
        )
