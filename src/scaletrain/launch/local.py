"""Local ranks through the torchrun agent (torch.distributed.launcher, the engine behind `torchrun`).

The agent starts the worker group, meets the other hosts' agents at the c10d rendezvous, watches the workers, and
restarts the whole group up to launch.max_restarts times when one fails. Nothing listens on every interface: a
single-host run keeps the rendezvous store, rank 0's store and gloo's sockets on 127.0.0.1; a multi-node run binds
them to the rendezvous host's address and this host's launch.local_addr (see launch/network.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import multiprocessing
import os
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psutil

from scaletrain.config.schema import JobConfig, LaunchConfig
from scaletrain.launch import network, rank_server


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's pick), for ranks of this host to meet at."""
    with network.listening_socket(network.LOOPBACK, 0) as s:
        return s.getsockname()[1]


def _run_rank(rank: int, fn, nproc: int, port: int, args: tuple, out) -> None:
    out.put((rank, fn(rank, nproc, port, *args)))


def run_local_ranks(fn, nproc: int, args: tuple = (), start_method: str = "spawn") -> list:
    """`fn(rank, nproc, port, *args)` in `nproc` fresh local processes meeting at 127.0.0.1:port (a free port),
    without the torchrun agent (no rendezvous, no restarts: a measurement, not a job); each rank's return value,
    by rank. One rank runs here with port None. ProcessRaisedException when a rank raises."""
    import torch.multiprocessing as mp

    if nproc == 1:
        return [fn(0, 1, None, *args)]
    out = mp.get_context(start_method).SimpleQueue()
    mp.start_processes(
        _run_rank, args=(fn, nproc, free_port(), args, out), nprocs=nproc, join=True, start_method=start_method
    )
    results = dict(out.get() for _ in range(nproc))
    return [results[r] for r in range(nproc)]


@dataclass
class LocalRendezvous:
    """Where this host's agent meets the others and where its workers listen."""

    endpoint: str  # host:port of the rendezvous store
    listen_addr: str  # this host's address for rank 0's store and the collectives' sockets
    server: object | None  # the rendezvous TCPStore when this host serves it (kept alive for the whole run)


def open_rendezvous(launch: LaunchConfig, fields: network.EndpointFields = network.CONFIG_FIELDS) -> LocalRendezvous:
    """Bind the rendezvous store if this host serves it. ValueError (one line naming the field as `fields` calls
    it) for a bad endpoint, address or taken port, before any rank starts."""
    host, port = network.split_endpoint(launch.rdzv_endpoint, fields.endpoint)
    listen_addr = network.listen_address(launch.nnodes, launch.rdzv_endpoint, launch.local_addr, fields)
    if launch.nnodes == 1:
        host = network.LOOPBACK  # one host: no other machine needs to reach the store, whatever host was named
    else:
        host = network.resolve(host, fields.endpoint)
        if ipaddress.ip_address(host).is_loopback:
            raise ValueError(
                f"{fields.endpoint}: {launch.rdzv_endpoint} is a loopback address; a multi-node "
                f"run needs the rendezvous host's address every node can reach"
            )
        if host not in network.local_addresses():
            return LocalRendezvous(f"{host}:{port}", listen_addr, None)  # another host serves the store
    try:
        sock = network.listening_socket(host, port)
    except OSError as e:
        if launch.nnodes > 1 and network.port_in_use(e):
            # another node's agent on this same machine got there first and serves it (torch does the same)
            return LocalRendezvous(f"{host}:{port}", listen_addr, None)
        raise ValueError(
            f"{fields.endpoint}: cannot listen on {host}:{port} ({e.strerror}); pick a free port or port 0"
        ) from None
    port = sock.getsockname()[1]
    server = network.tcp_store_server(host, port, timeout_s=300, sock=sock)
    return LocalRendezvous(f"{host}:{port}", listen_addr, server)


# torch's fixed grace between SIGTERM and SIGKILL where its LaunchConfig has no shutdown_timeout (torch 2.11, 2.12:
# the worker context's close(timeout=30)); also launch.shutdown_timeout_s's default
TORCH_FIXED_SHUTDOWN_S = 30


def _agent_fields() -> frozenset[str]:
    from torch.distributed.launcher.api import LaunchConfig as AgentConfig

    return frozenset(f.name for f in dataclasses.fields(AgentConfig))


def check_agent_supports(launch: LaunchConfig) -> None:
    """ValueError (one line) for a launch setting this torch's agent cannot honour: launch.shutdown_timeout_s
    other than 30 s needs LaunchConfig.shutdown_timeout (torch 2.13; 2.11 and 2.12 always wait 30 s)."""
    if launch.shutdown_timeout_s != TORCH_FIXED_SHUTDOWN_S and "shutdown_timeout" not in _agent_fields():
        import torch

        raise ValueError(
            f"launch.shutdown_timeout_s: torch {torch.__version__.split('+')[0]} stops workers after a fixed "
            f"{TORCH_FIXED_SHUTDOWN_S} s; set launch.shutdown_timeout_s={TORCH_FIXED_SHUTDOWN_S} or use torch >= 2.13"
        )


def agent_config(shutdown_timeout_s: int = TORCH_FIXED_SHUTDOWN_S, **fields):
    """torch's LaunchConfig (the torchrun agent's) from `fields`, on every supported torch: shutdown_timeout is
    passed only where LaunchConfig has it (torch 2.13); older agents wait their fixed 30 s (check_agent_supports
    refuses another value before launch)."""
    from torch.distributed.launcher.api import LaunchConfig as AgentConfig

    if "shutdown_timeout" in _agent_fields():
        fields["shutdown_timeout"] = shutdown_timeout_s
    return AgentConfig(**fields)


# after a failed multi-node run, how long the node serving the rendezvous store keeps it for the other nodes' agents
# (they poll it every monitor_interval, 0.2 s, and see their own ranks end within a few polls)
STORE_GRACE_S = 5.0


def run_id(cfg: JobConfig) -> str:
    """The rendezvous id: every node's agent must use the same one to meet (a random one per process never would)."""
    if cfg.launch.nnodes == 1:
        return f"scaletrain-{cfg.run.name}-{uuid.uuid4().hex[:8]}"
    return f"scaletrain-{cfg.run.name}"  # the rendezvous store is fresh for each launch: no stale round to meet


def worker_environment(rdzv: LocalRendezvous, nproc_per_node: int) -> None:
    """The environment this host's ranks inherit (set in this process before they start)."""
    # one intra-op thread pool per rank sized to the host, instead of every rank grabbing every core
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc_per_node)))
    # Workers get a fresh TCPStore each round instead of sharing the agent's rendezvous store: with the shared
    # store a restarted group can read the previous round's addresses and fail to connect (pytorch#135712; seen
    # here as "Gloo connectFullMesh failed ... Connection refused" on the first restart after a SIGKILL).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # gloo and NCCL bind their sockets to this interface's address, not the one the hostname resolves to
    interface = network.interface_of(rdzv.listen_addr)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    os.environ["SCALETRAIN_NODE_ADDR"] = rdzv.listen_addr  # names this node in the rendezvous check's messages


# what every rank imports before its first step, preloaded by forked_ranks' server: the ranks' entry and the trainer
# (the launching command imports neither: ~3.5 s of CPU); torch._dynamo, which torch imports on the first initialiser
# run under a device context (building the model: ~0.8 s per rank); TensorBoard's writer (the monitor's, ~0.2 s)
RANK_IMPORTS = ("scaletrain.train.worker", "scaletrain.train.loop", "torch._dynamo", "torch.utils.tensorboard")


@contextmanager
def forked_ranks(*modules: str) -> Iterator[str]:
    """The start method for this host's rank processes: forked from one server process that imported `modules` (torch
    and the trainer) once, instead of spawning each rank to import them again (~3.5 s of CPU per rank on a 2-core
    host: a 10-step job on 4 CPU ranks ended 5 s sooner); a rank restarted by the agent or the
    in-process launcher is forked at once too. multiprocessing's forkserver: the server is a fresh interpreter, so no
    thread, OpenMP pool or CUDA context of this process is forked; it holds the job's signals (launch/rank_server.py).
    Call it after this host's environment for the ranks is set (worker_environment): the ranks inherit the server's.
    The server stops with the block, so a later launch from this process starts one with its own environment; so do
    the processes the ranks left behind (end_leftovers)."""
    before = adopt_orphans()
    try:
        if "forkserver" not in multiprocessing.get_all_start_methods():
            yield "spawn"
            return
        from multiprocessing import forkserver

        os.environ[rank_server.SERVER_OF] = str(os.getpid())  # read by the server as it starts, by nothing later
        try:
            forkserver.set_forkserver_preload(["scaletrain.launch.rank_server", *modules])
            forkserver.ensure_running()  # it imports while this process rendezvouses
        finally:
            del os.environ[rank_server.SERVER_OF]
        try:
            yield "forkserver"
        finally:
            stop = getattr(forkserver._forkserver, "_stop", None)  # CPython's own (3.8+); its ranks have ended
            if stop is not None:
                stop()
    finally:
        end_leftovers(before)


def adopt_orphans() -> set[int]:
    """Make this process the one that inherits the orphans of its descendants (Linux's child subreaper) instead of
    init, and return the pids of its children now: a process a rank started and left behind when it was SIGKILLed
    (DCP's writer process, still waiting for its process group) would otherwise outlive the launch, holding the
    command's output open, for as long as its 30-minute timeout."""
    if sys.platform == "linux":
        import ctypes

        pr_set_child_subreaper = 36
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1, 0, 0, 0)
    return {p.pid for p in psutil.Process().children()}


def end_leftovers(before: set[int], grace_s: float = 5.0) -> None:
    """SIGTERM, then after `grace_s` SIGKILL, every child of this process that was not one `before` the launch and is
    not multiprocessing's resource tracker: once the ranks and the server have ended, what the ranks left behind."""
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    left = [p for p in psutil.Process().children() if p.pid not in before and p.pid != tracker]
    for p in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(left, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=grace_s)


def _caller_name(depth: int = 2) -> str:
    """What torch's dynamic_rendezvous.get_method_name returns (the name of the function `depth` frames up), by a
    frame walk instead of inspect.stack()."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


def speed_up_rendezvous_events() -> None:
    """torch's c10d rendezvous names each of its ~18 events per round with inspect.stack(), which reads the source
    of every frame and scans sys.modules: 2-4 s per launch and per restart on a 2-core host with torch imported
    (torch 2.11-2.13, dynamic_rendezvous.get_method_name). The event name is all it needs: give it a frame walk."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    if hasattr(dynamic_rendezvous, "get_method_name"):
        dynamic_rendezvous.get_method_name = _caller_name


def launch_local(cfg: JobConfig, nproc_per_node: int, rdzv: LocalRendezvous | None = None) -> dict:
    """Run the job on nproc_per_node local ranks; returns rank 0's summary. Raises ChildFailedError on failure."""
    from torch.distributed.launcher.api import elastic_launch

    from scaletrain.train.worker import run_from_dict

    rdzv = rdzv or open_rendezvous(cfg.launch)
    worker_environment(rdzv, nproc_per_node)
    speed_up_rendezvous_events()
    with forked_ranks(*RANK_IMPORTS) as start_method:
        launch = agent_config(
            cfg.launch.shutdown_timeout_s,
            min_nodes=cfg.launch.min_nodes or cfg.launch.nnodes,
            max_nodes=cfg.launch.nnodes,
            nproc_per_node=nproc_per_node,
            run_id=run_id(cfg),
            rdzv_backend="c10d",
            rdzv_endpoint=rdzv.endpoint,
            max_restarts=cfg.launch.max_restarts,
            # is_host=False: the agent joins as a client of our store; its own would listen on every interface
            # last_call_timeout: how long an elastic round that reached min_nodes waits for more (torch's default 30 s)
            rdzv_configs={"is_host": False, "last_call_timeout": 10},
            # MASTER_ADDR of the workers: rank 0 binds its store there (parallel/runtime.py)
            local_addr=rdzv.listen_addr,
            monitor_interval=0.2,
            start_method=start_method,
            # SIGUSR1 is Slurm's advance warning (--signal=B:USR1@N): the agent then stops its workers with SIGTERM,
            # which they answer by finishing the step and saving a checkpoint
            signals_to_handle="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        )
        try:
            results = elastic_launch(launch, run_from_dict)(cfg.model_dump())
        except BaseException:
            if rdzv.server is not None and cfg.launch.nnodes > 1:
                # torch's agents wait for each other only after a success (the exit barrier): after a failure every
                # other node's agent still polls this store until it sees its own ranks end; closing it at once made
                # such an agent crash on the lost connection instead of reporting its ranks' one line
                time.sleep(STORE_GRACE_S)
            raise
        finally:
            rdzv.server = None  # the agent has left the rendezvous: close the store
    # rank 0's summary; another node's agent only has its own ranks' results
    return results.get(0) or next(iter(results.values()), {})
