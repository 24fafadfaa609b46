"""Local ranks through the torchrun agent (torch.distributed.launcher, the engine behind `torchrun`).

The agent starts the worker group, hosts the c10d rendezvous on 127.0.0.1 for single-host runs, watches the
workers, and restarts the whole group up to launch.max_restarts times when one fails.
"""

from __future__ import annotations

import os
import socket
import uuid

from scaletrain.config.schema import JobConfig


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous_endpoint(endpoint: str) -> str:
    host, _, port = endpoint.rpartition(":")
    if port in ("", "0"):
        return f"{host or '127.0.0.1'}:{free_port()}"
    return endpoint


def launch_local(cfg: JobConfig, nproc_per_node: int) -> dict:
    """Run the job on nproc_per_node local ranks; returns rank 0's summary. Raises ChildFailedError on failure."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from scaletrain.train.worker import run_from_dict

    # one intra-op thread pool per rank sized to the host, instead of every rank grabbing every core
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc_per_node)))
    # Workers get a fresh TCPStore each round instead of sharing the agent's rendezvous store: with the shared
    # store a restarted group can read the previous round's addresses and fail to connect (pytorch#135712; seen
    # here as "Gloo connectFullMesh failed ... Connection refused" on the first restart after a SIGKILL).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    launch = LaunchConfig(
        min_nodes=cfg.launch.nnodes, max_nodes=cfg.launch.nnodes, nproc_per_node=nproc_per_node,
        run_id=f"scaletrain-{cfg.run.name}-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
        rdzv_endpoint=rendezvous_endpoint(cfg.launch.rdzv_endpoint), max_restarts=cfg.launch.max_restarts,
        monitor_interval=0.2, start_method="spawn", local_addr="127.0.0.1" if cfg.launch.nnodes == 1 else None,
        # SIGUSR1 is Slurm's advance warning (--signal=B:USR1@N): the agent then stops its workers with SIGTERM,
        # which they answer by finishing the step and saving a checkpoint
        signals_to_handle="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", shutdown_timeout=cfg.launch.shutdown_timeout_s)
    results = elastic_launch(launch, run_from_dict)(cfg.model_dump())
    return results[0]
