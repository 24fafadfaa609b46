"""Where a run's rendezvous stores and collective sockets listen: 127.0.0.1 for a single-host run, one named address
of this host for a multi-node run -- never every interface. The agent's side: checking launch.rdzv_endpoint and
launch.local_addr and choosing the listen address; the sockets themselves are in parallel/network.py, which the ranks
use too.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from dataclasses import dataclass

from scaletrain.parallel.network import (  # noqa: F401  (the agent uses them through this module)
    LOOPBACK,
    interface_of,
    is_ip,
    listening_socket,
    local_addresses,
    tcp_store_server,
)


@dataclass(frozen=True)
class EndpointFields:
    """What a front end calls the rendezvous endpoint and this host's address, for the one-line errors."""

    endpoint: str = "launch.rdzv_endpoint"
    local_addr: str | None = "launch.local_addr"  # None: the front end has no such setting


CONFIG_FIELDS = EndpointFields()
NODE_FLAGS = EndpointFields("--rdzv-endpoint", None)  # `bench --nodes`, `doctor --nodes`: no local_addr


def split_endpoint(endpoint: str, field: str = CONFIG_FIELDS.endpoint) -> tuple[str, int]:
    """'host:port' -> (host, port); '[::1]:port' too. ValueError naming `field` if malformed."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 2**16:
        raise ValueError(f"{field}: '{endpoint}' is not host:port (e.g. 127.0.0.1:0 or node1:29500)")
    return host.strip("[]"), int(port)


def resolve(host: str, field: str = CONFIG_FIELDS.endpoint) -> str:
    """The address `host` names from this host (IPv4 first). ValueError naming `field` if it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(
            f"{field}: cannot resolve host '{host}' ({e.strerror}); give a name or IP address this host can resolve"
        ) from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0])


def listen_address(
    nnodes: int, rdzv_endpoint: str, local_addr: str = "", fields: EndpointFields = CONFIG_FIELDS
) -> str:
    """This host's address for the workers' store and collective sockets: 127.0.0.1 on one host; across hosts
    launch.local_addr, else the address of the interface that routes to the rendezvous host.
    ValueError (one line naming the field as `fields` calls it) when that address is not one of this host's or is
    loopback."""
    if nnodes == 1:
        return LOOPBACK
    if local_addr:
        if local_addr not in local_addresses():
            raise ValueError(
                f"{fields.local_addr}: {local_addr} is not an address of this host "
                f"({', '.join(sorted(local_addresses()))}); give the address the other nodes reach "
                f"this host by"
            )
        return local_addr
    host, port = split_endpoint(rdzv_endpoint, fields.endpoint)
    target = resolve(host, fields.endpoint)
    with socket.socket(socket.AF_INET6 if ":" in target else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((target, port or 9))  # UDP connect sends nothing: it only asks the routing table
        addr = s.getsockname()[0]
    if ipaddress.ip_address(addr).is_loopback:
        or_local_addr = f", or set {fields.local_addr}" if fields.local_addr else ""
        raise ValueError(
            f"{fields.endpoint}: '{host}' is {target} on this host, a loopback address the other "
            f"nodes cannot reach; name the rendezvous host by the address they use{or_local_addr}"
        )
    return addr


def port_in_use(exc: OSError) -> bool:
    return exc.errno == errno.EADDRINUSE
