"""`scaletrain bench --nodes N`: this node's agent. All nodes run the local bench (hardware/bench.py) at the same
time, then one torchrun agent per node meets the others at the c10d rendezvous (as `scaletrain train --nnodes N`)
and its ranks time the collectives over every node's ranks (hardware/internode.py). Node 0 returns the calibration.
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import timedelta

import torch

from scaletrain.hardware.calibration import Calibration
from scaletrain.hardware.internode import (
    STORE_TIMEOUT_S,
    NodeBenchError,
    compare_nodes,
    internode_fields,
    measure_world_collectives,
    message_sizes,
)
from scaletrain.hardware.kernels import MIB
from scaletrain.launch.bench_local import run_bench


def _node_record(node_rank: int, addr: str, nproc: int, sizes: tuple[int, ...]) -> dict:
    from importlib.metadata import version

    return {"node": node_rank, "addr": addr, "nproc": nproc, "sizes": list(sizes), "torch": torch.__version__} | {
        "scaletrain": version("scaletrain")
    }


def _store(endpoint: str, server):
    """The rendezvous store: node 0's own server, or a client of it."""
    from torch.distributed import TCPStore

    if server is not None:
        return server
    host, port = endpoint.rsplit(":", 1)
    return TCPStore(host.strip("[]"), int(port), is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S))


def _meet(store, nodes: int, node_rank: int, record: dict, stage: str) -> list[dict | None]:
    """Wait for every node's agent (torch elastic's store barrier) and return what each published. Node 0, whose
    process serves the store and may close it as soon as this returns (a refusal, the end), returns only once every
    node has read: under load a node still reading lost the connection."""
    from torch.distributed.elastic.utils.store import barrier, store_timeout

    prefix = f"scaletrain-bench/{stage}"
    store.set(f"{prefix}/node{node_rank}", json.dumps(record))
    barrier(store, nodes, f"{prefix}/barrier", barrier_timeout=STORE_TIMEOUT_S)
    keys = [f"{prefix}/node{i}" for i in range(nodes)]
    records = [json.loads(store.get(k)) if store.check([k]) else None for k in keys]
    if store.add(f"{prefix}/read", 1) == nodes:
        store.set(f"{prefix}/all-read", "")  # acknowledged by the server before this node lets go of the store
    if node_rank == 0:
        with store_timeout(store, STORE_TIMEOUT_S):
            store.wait([f"{prefix}/all-read"])
    return records


def run_node_bench(
    nodes: int,
    node_rank: int,
    endpoint: str,
    nproc: int,
    max_bytes: int = 16 * MIB,
    matmul_n: int | None = None,
) -> Calibration | None:
    """This node's part of a bench over `nodes` nodes meeting at `endpoint` (HOST:PORT, served by the node that
    owns HOST): the local bench over its `nproc` ranks, then the collectives over all nodes' ranks. Returns the
    calibration on node 0, None on the others. ValueError (one line) for a bad endpoint or nodes that disagree."""
    holder: dict[str, Calibration] = {}

    def local() -> None:
        holder["cal"] = run_bench(nproc=nproc, matmul_n=matmul_n, collective_bytes=max_bytes)  # every node at once

    points = measure_across_nodes(nodes, node_rank, endpoint, nproc, max_bytes, before=local)
    if node_rank != 0:
        return None
    return dataclasses.replace(holder["cal"], **internode_fields(points, nodes, nproc))


def measure_across_nodes(
    nodes: int, node_rank: int, endpoint: str, nproc: int, max_bytes: int = 16 * MIB, before=None, amid: bool = True
) -> dict[str, list]:
    """Meet the other nodes' agents at `endpoint` (refusing nodes whose --nproc, message sizes, torch or
    scaletrain differ: NodeBenchError, one line), run `before()` on every node at once (bench's local
    measurements), then time the collectives over every rank of every node and inside each node
    (hardware/internode.py measure_world_collectives; amid=False: not the waits amid compute). Returns its
    points, the same on every node."""
    from torch.distributed.launcher.api import elastic_launch

    from scaletrain.config.schema import LaunchConfig
    from scaletrain.launch import network
    from scaletrain.launch.local import agent_config, open_rendezvous, speed_up_rendezvous_events

    # unvalidated: open_rendezvous checks the endpoint and names it as the flag (a ValidationError would not)
    launch = LaunchConfig.model_construct(nnodes=nodes, node_rank=node_rank, rdzv_endpoint=endpoint)
    rdzv = open_rendezvous(launch, network.NODE_FLAGS)
    store = _store(rdzv.endpoint, rdzv.server)
    sizes = message_sizes(max_bytes)
    problem = compare_nodes(
        _meet(store, nodes, node_rank, _node_record(node_rank, rdzv.listen_addr, nproc, sizes), "start"), nodes
    )
    if problem:
        raise NodeBenchError(problem)
    on_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= nproc
    if before is not None:
        before()
        _meet(store, nodes, node_rank, {}, "local-done")  # nobody's compute overlaps the collectives below

    interface = network.interface_of(rdzv.listen_addr)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as launch/local.py, pytorch#135712
    agent = agent_config(
        min_nodes=nodes,
        max_nodes=nodes,
        nproc_per_node=nproc,
        run_id="scaletrain-bench-nodes",
        rdzv_backend="c10d",
        rdzv_endpoint=rdzv.endpoint,
        rdzv_configs={"is_host": False},  # a client of our store, which listens on one address only
        local_addr=rdzv.listen_addr,
        max_restarts=0,
        monitor_interval=0.2,
        start_method="spawn",
    )
    speed_up_rendezvous_events()
    try:
        results = elastic_launch(agent, measure_world_collectives)(sizes, "cuda" if on_gpu else "cpu", amid)
        # a node's agent has left the rendezvous only when its elastic_launch returns: node 0, whose process serves
        # the store, keeps it open until every node has (under load it closed first, and node 1's agent failed to
        # shut its rendezvous down on the lost connection)
        _meet(store, nodes, node_rank, {}, "left")
    finally:
        rdzv.server = None
    return next(iter(results.values()))  # every rank returns the same slowest-rank times
