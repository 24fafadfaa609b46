"""Sockets and stores the ranks listen on: rank 0's store bound to MASTER_ADDR only, never every interface; the
agent side (which address a run uses) is in launch/network.py.

torch 2.13's TCPStore server listens on every interface whatever host name it is given (checked with `ss -ltn`:
`*:PORT`); only a socket we bind ourselves and hand over as `master_listen_fd` narrows it. Gloo's (and NCCL's)
sockets follow GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, set to the interface that holds the listen address.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from datetime import timedelta

import psutil

LOOPBACK = "127.0.0.1"


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def local_addresses() -> dict[str, str]:
    """IP address -> name of the interface of this host that holds it."""
    return {
        a.address.split("%")[0]: name
        for name, addrs in psutil.net_if_addrs().items()
        for a in addrs
        if a.family in (socket.AF_INET, socket.AF_INET6)
    }


def interface_of(addr: str) -> str:
    """Name of the interface that holds `addr` ('lo' for 127.0.0.1 on Linux)."""
    try:
        return local_addresses()[addr]
    except KeyError:
        raise ValueError(f"launch.local_addr: {addr} is not an address of this host") from None


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (port 0: a free one) and listening. OSError if the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore does: restart on a TIME_WAIT port
        sock.bind((host, port))
        sock.listen(4096)
    except OSError:
        sock.close()
        raise
    return sock


def tcp_store_server(
    host: str, port: int, timeout_s: float, world_size: int | None = None, sock: socket.socket | None = None
):
    """A TCPStore server listening on host:port only (not every interface), or on `sock` if given.
    The store takes ownership of the socket (it closes the descriptor when destroyed)."""
    from torch.distributed import TCPStore

    sock = sock or listening_socket(host, port)
    port = sock.getsockname()[1]
    return TCPStore(
        host,
        port,
        world_size=world_size,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        multi_tenant=True,
        master_listen_fd=sock.detach(),
    )


def worker_store(environ, timeout_s: float):
    """The env:// store of a torchrun worker with rank 0's server bound to MASTER_ADDR only; None where torch's
    own env:// rendezvous is right (the agent's shared store, or MASTER_ADDR a host name we cannot bind to).
    A loopback MASTER_ADDR also pins gloo to the loopback interface (GLOO_SOCKET_IFNAME, unless set)."""
    from torch.distributed import TCPStore

    addr, port = environ.get("MASTER_ADDR", ""), environ.get("MASTER_PORT", "")
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or not is_ip(addr) or not port.isdigit():
        return None
    if ipaddress.ip_address(addr).is_loopback:
        # every rank is on this host (mpirun on one host): keep gloo's sockets off the hostname's interface too
        environ.setdefault("GLOO_SOCKET_IFNAME", interface_of(addr))
    rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
    if rank != 0:
        return TCPStore(
            addr, int(port), world_size=world, is_master=False, timeout=timedelta(seconds=timeout_s), multi_tenant=True
        )
    try:
        sock = listening_socket(addr, int(port))
    except OSError as e:
        if e.errno == errno.EADDRNOTAVAIL:
            return None  # MASTER_ADDR is not this host's own address (NAT): leave it to torch
        raise
    return tcp_store_server(addr, int(port), timeout_s, world_size=world, sock=sock)
