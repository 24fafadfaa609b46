"""`scaletrain doctor`: is this host fit for multi-GPU work? A thin wrapper over scaletrain.doctor."""

from __future__ import annotations

import json
import sys

import click

from scaletrain.cli.nodes import node_options

_MARK = {"pass": "PASS", "warn": "WARN", "fail": "FAIL", "skip": "SKIP"}


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
@click.option("--no-bandwidth", is_flag=True, help="Skip the measured all-reduce.")
@click.option(
    "--nproc",
    type=click.IntRange(min=2),
    default=None,
    help="Local ranks for the all-reduce (default: every GPU, or 2 CPU ranks).",
)
@node_options(
    "Nodes, one `scaletrain doctor` each (as `train --nnodes`): also check that they agree and measure "
    "all-reduce, all-gather and reduce-scatter across them."
)
def doctor(
    as_json: bool, no_bandwidth: bool, nproc: int | None, nodes: int, node_rank: int | None, rdzv_endpoint: str | None
) -> None:
    """Check this host for multi-GPU work: GPUs, links, network, versions, /dev/shm, ulimits, all-reduce.

    With `--nodes N --node-rank K --rdzv-endpoint HOST:PORT` on each of N nodes, also across the nodes: that they
    meet and run the same torch and scaletrain, and the bus bandwidth of collectives over every rank of every node
    and inside each node while all run (`scaletrain bench --nodes` writes the same into a calibration).

    Exit code 1 when a check fails, 0 otherwise (warnings included).
    """
    from scaletrain.cli.errors import fail
    from scaletrain.cli.nodes import check_node_flags
    from scaletrain.doctor import run_doctor

    across = nodes > 1 or node_rank is not None or rdzv_endpoint is not None
    if across:
        from scaletrain.launch import network

        check_node_flags(nodes, node_rank, rdzv_endpoint, "doctor")
        try:  # the endpoint's form and name before the local checks; the rendezvous checks the rest
            network.resolve(network.split_endpoint(str(rdzv_endpoint), "--rdzv-endpoint")[0], "--rdzv-endpoint")
        except ValueError as e:
            fail(str(e))
    checks = run_doctor(bandwidth=not no_bandwidth, nproc=nproc)
    if across:
        import torch

        from scaletrain.doctor.checks import check_nodes

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        assert node_rank is not None and rdzv_endpoint is not None  # check_node_flags
        try:
            checks += check_nodes(nodes, node_rank, rdzv_endpoint, nproc or gpus or 2, 16 * 2**20)
        except ValueError as e:
            fail(str(e))
    if as_json:
        click.echo(json.dumps([c.as_dict() for c in checks], indent=2))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            click.echo(f"{_MARK[c.status]}  {c.name:<{width}}  {c.detail}")
        counts = {s: sum(c.status == s for c in checks) for s in _MARK}
        click.echo(f"{counts['pass']} pass, {counts['warn']} warn, {counts['fail']} fail, {counts['skip']} not checked")
    sys.exit(1 if any(c.status == "fail" for c in checks) else 0)
