"""Rendezvous safety across nodes: every node must run the same job with the same software.

Right after the process group exists and before the first collective, local rank 0 of each node publishes its
fingerprint (the job config without its node-local fields, scaletrain, torch and Python versions, the node's
address and `launch.node_rank`) in the group's store; rank 0 compares them and publishes a verdict that every rank
waits for. A difference stops every rank with one line naming the node and the difference, instead of a hang (a
different layout builds different groups) or a silent mismatch (a different learning rate, a different torch).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from scaletrain.config import JobConfig

# fields that differ between nodes by design
NODE_LOCAL = {"launch.local_addr", "launch.node_rank"}
NODE_ADDR_ENV = "SCALETRAIN_NODE_ADDR"  # set by the agent (launch/local.py) for its workers
_SHOWN = 3  # differing config fields named in the message


class NodeMismatchError(Exception):
    """A node runs a different config or software than node 0; the message is the one line for the user."""


def _flat(tree: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{name}."))
        else:
            out[name] = value
    return out


def fingerprint(cfg: JobConfig) -> dict:
    """What must be equal on every node, plus who this node is."""
    from scaletrain import __version__

    fields = {k: v for k, v in _flat(cfg.model_dump(mode="json")).items() if k not in NODE_LOCAL}
    blob = json.dumps(fields, sort_keys=True)
    return {
        "addr": os.environ.get(NODE_ADDR_ENV) or socket.gethostname(),
        "node_rank": cfg.launch.node_rank,
        "group_rank": int(os.environ.get("GROUP_RANK", "0")),
        "scaletrain": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "config_sha256": hashlib.sha256(blob.encode()).hexdigest(),
        "config": fields,
    }


def _name(fp: dict) -> str:
    number = fp["node_rank"] if fp["node_rank"] >= 0 else fp["group_rank"]
    return f"node {number} ({fp['addr']})"


def compare(fps: list[dict]) -> str:
    """'' when every node matches the first; else one line naming the first node that differs and how."""
    ref = fps[0]
    claimed: dict[int, dict] = {}
    for fp in fps:
        other = claimed.setdefault(fp["node_rank"], fp) if fp["node_rank"] >= 0 else fp
        if other is not fp:
            return (
                f"launch.node_rank: {fp['node_rank']} is given by two nodes ({other['addr']} and {fp['addr']}); "
                f"give each node its own --node-rank"
            )
    for fp in fps[1:]:
        for what in ("scaletrain", "torch", "python"):
            if fp[what] != ref[what]:
                return (
                    f"{_name(fp)} runs {what} {fp[what]} but {_name(ref)} runs {ref[what]}; "
                    f"install the same {what} on every node"
                )
        if fp["config_sha256"] != ref["config_sha256"]:
            keys = sorted(set(fp["config"]) | set(ref["config"]))
            diff = [k for k in keys if fp["config"].get(k) != ref["config"].get(k)]
            shown = ", ".join(f"{k}={fp['config'].get(k)!r} vs {ref['config'].get(k)!r}" for k in diff[:_SHOWN])
            more = f" (and {len(diff) - _SHOWN} more)" if len(diff) > _SHOWN else ""
            return (
                f"{_name(fp)} has a different job config than {_name(ref)}: {shown}{more}; "
                f"start every node with the same config and overrides"
            )
    return ""


def check_same_job(cfg: JobConfig, timeout_s: float) -> None:
    """Compare every node's fingerprint (a no-op on one node). Raises NodeMismatchError on every rank if any
    node differs. Uses only the process group's store: no collective runs before the verdict."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    world = dist.get_world_size() if dist.is_initialized() else 1
    if local_world <= 0 or world <= local_world:
        return
    nodes = world // local_world
    # the default group's store (torch keeps no public getter; present in every torch this project supports)
    store = dist.distributed_c10d._get_default_store()
    # not keyed by TORCHELASTIC_RESTART_COUNT: a node that was lost and started again counts from 0 while the
    # others count on (seen: a deadlock). Each round's store is fresh (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in
    # launch/local.py; torch prefixes the agent's shared store per attempt itself).
    prefix = "scaletrain/fingerprint"
    timeout = timedelta(seconds=timeout_s)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        me = fingerprint(cfg)
        store.set(f"{prefix}/node{me['group_rank']}", json.dumps(me))
    if dist.get_rank() == 0:
        keys = [f"{prefix}/node{g}" for g in range(nodes)]
        store.wait(keys, timeout)
        store.set(f"{prefix}/verdict", compare([json.loads(store.get(k)) for k in keys]))
    store.wait([f"{prefix}/verdict"], timeout)
    verdict = store.get(f"{prefix}/verdict").decode()
    if verdict:
        raise NodeMismatchError(verdict)
