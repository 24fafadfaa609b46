"""Simulated nodes on one machine: each node a network namespace with its own address, joined by a bridge that
lives in a namespace of its own, the node-to-node link shaped with `tc tbf` (netem is not in this kernel).

Every name carries the prefix `stc<pid>-` of the process that made it, so parallel test runs cannot collide, and
`Cluster.create` first deletes whatever a dead process with that prefix left behind. Addresses are in the
documentation range 198.51.100.0/24 and exist only inside these namespaces; loopback inside a node is unshaped.
Needs root and `ip`/`tc` (iproute2); `unavailable()` says why not, for a skip; `make_cluster` is the fixture body.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

SUBNET = "198.51.100"  # RFC 5737 TEST-NET-2: never routed anywhere
PREFIX = "stc"  # scaletrain cluster; a name is PREFIX<pid>-<what>
_NAME = re.compile(rf"^{PREFIX}(\d+)-")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def pids_in(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split()]


def kill_namespace(ns: str, sig: int = signal.SIGKILL) -> list[int]:
    """Send `sig` to every process inside namespace `ns` (a node failure: the agent and all its ranks)."""
    pids = pids_in(ns)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


def delete_namespace(ns: str) -> None:
    """Kill what runs in it, then delete it (its veth ends go with it)."""
    for _ in range(50):
        if not kill_namespace(ns):
            break
        time.sleep(0.1)
    _ip("netns", "del", ns, check=False)


def clean_leftovers(own_pid: int | None = None) -> list[str]:
    """Delete namespaces with our prefix whose maker is dead (or is `own_pid`: a set-up done again)."""
    removed = []
    for ns in namespaces():
        m = _NAME.match(ns)
        if m and (int(m.group(1)) == own_pid or not _alive(int(m.group(1)))):
            delete_namespace(ns)
            removed.append(ns)
    return removed


def unavailable() -> str | None:
    """Why simulated nodes cannot be made here, or None."""
    if os.geteuid() != 0:
        return "simulated nodes need root (network namespaces)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"simulated nodes need iproute2's `{tool}`"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    _ip("netns", "del", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    return None


@dataclass
class Node:
    index: int
    ns: str  # network namespace
    addr: str  # its address on the inter-node network
    ifname: str = "eth0"  # its interface on that network (GLOO_SOCKET_IFNAME)

    def command(self, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *args]

    def popen(self, args: list[str], **kwargs) -> subprocess.Popen:
        """Start `args` inside this node."""
        return subprocess.Popen(self.command(args), **kwargs)

    def kill(self) -> list[int]:
        """SIGKILL every process of this node: a node failure."""
        return kill_namespace(self.ns)


@dataclass
class Cluster:
    nodes: list[Node]
    switch: str  # the namespace holding the bridge
    rate: str | None = None
    made: list[str] = field(default_factory=list)

    @classmethod
    def create(cls, n: int, rate: str | None = None) -> Cluster:
        """n nodes (2-4) on one bridge; `rate` (e.g. '1gbit') shapes every node's outgoing link, None leaves it
        unshaped. Idempotent: deletes what a previous set-up of this process or a dead one left."""
        if not 1 <= n <= 250:
            raise ValueError(f"nodes: {n} is not in 1..250")
        pid = os.getpid()
        clean_leftovers(own_pid=pid)
        switch = f"{PREFIX}{pid}-sw"
        cluster = cls([], switch)
        try:
            _ip("netns", "add", switch)
            cluster.made.append(switch)
            _ip("-n", switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", switch, "link", "set", "br0", "up")
            for i in range(n):
                node = Node(i, f"{PREFIX}{pid}-n{i}", f"{SUBNET}.{i + 1}")
                _ip("netns", "add", node.ns)
                cluster.made.append(node.ns)
                # both ends made inside namespaces: nothing appears, even briefly, in the host's namespace
                _ip("-n", switch, "link", "add", f"p{i}", "type", "veth", "peer", "name", node.ifname, "netns", node.ns)
                _ip("-n", switch, "link", "set", f"p{i}", "master", "br0", "up")
                _ip("-n", node.ns, "addr", "add", f"{node.addr}/24", "dev", node.ifname)
                _ip("-n", node.ns, "link", "set", node.ifname, "up")
                _ip("-n", node.ns, "link", "set", "lo", "up")
                cluster.nodes.append(node)
            cluster.shape(rate)
        except BaseException:
            cluster.close()
            raise
        return cluster

    def shape(self, rate: str | None) -> None:
        """Shape every node's outgoing inter-node traffic to `rate` ('1gbit', '500mbit'); None removes the shaping.
        Each direction is shaped once, at its sender; loopback inside a node is untouched."""
        for node in self.nodes:
            subprocess.run(
                ["tc", "-n", node.ns, "qdisc", "del", "dev", node.ifname, "root"], capture_output=True, timeout=30
            )
            if rate is not None:
                subprocess.run(
                    ["tc", "-n", node.ns, "qdisc", "add", "dev", node.ifname, "root", "tbf", "rate", rate]
                    + ["burst", "256kb", "latency", "50ms"],
                    capture_output=True,
                    text=True,
                    check=True,
                    timeout=30,
                )
        self.rate = rate

    def close(self) -> None:
        """Kill every process in the nodes and delete every namespace made (safe to call twice)."""
        for ns in reversed(self.made):
            delete_namespace(ns)
        self.made.clear()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def make_cluster(n: int, rate: str | None = None):
    """Generator for a pytest fixture: skips with the reason when nodes cannot be simulated here, yields a
    Cluster and always tears it down (also after a failed test)."""
    import pytest

    why = unavailable()
    if why:
        pytest.skip(why)
    cluster = Cluster.create(n, rate)
    try:
        yield cluster
    finally:
        cluster.close()
