"""Flags of the commands run once per node (`bench --nodes`, `doctor --nodes`): one agent per node meeting at a
c10d rendezvous, as `scaletrain train --nnodes` does."""

from __future__ import annotations

import click

from scaletrain.cli.errors import fail


def node_options(nodes_help: str):
    """--nodes, --node-rank and --rdzv-endpoint of a command run once per node (`bench`, `doctor`)."""

    def add(command):
        for option in reversed(
            (
                click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True, help=nodes_help),
                click.option(
                    "--node-rank", type=click.IntRange(min=0), default=None, help="With --nodes: this node's number."
                ),
                click.option(
                    "--rdzv-endpoint", default=None, metavar="HOST:PORT", help="With --nodes: the c10d rendezvous."
                ),
            )
        ):
            command = option(command)
        return command

    return add


def check_node_flags(nodes: int, node_rank: int | None, rdzv_endpoint: str | None, command: str) -> None:
    """One line and exit 2 unless --nodes N (N >= 2), --node-rank and --rdzv-endpoint go together (`bench`,
    `doctor`: one agent per node, meeting as `train --nnodes` does)."""
    if nodes < 2:
        fail(f"--node-rank/--rdzv-endpoint: only with --nodes N (N >= 2); drop them for a one-node {command}")
    if node_rank is None or rdzv_endpoint is None:
        fail(f"--nodes {nodes}: also give --node-rank 0..{nodes - 1} and --rdzv-endpoint HOST:PORT on every node")
    if node_rank >= nodes:
        fail(f"--node-rank: {node_rank} is not below --nodes {nodes}; number the nodes 0..{nodes - 1}")
    if rdzv_endpoint.endswith(":0"):
        fail(f"--rdzv-endpoint: a multi-node {command} needs a fixed HOST:PORT every node can reach")
