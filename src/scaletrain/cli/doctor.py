"""`scaletrain doctor`: is this host fit for multi-GPU work? A thin wrapper over scaletrain.doctor."""

from __future__ import annotations

import json
import sys

import click

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
def doctor(as_json: bool, no_bandwidth: bool, nproc: int | None) -> None:
    """Check this host for multi-GPU work: GPUs, links, network, versions, /dev/shm, ulimits, all-reduce.

    Exit code 1 when a check fails, 0 otherwise (warnings included).
    """
    from scaletrain.doctor import run_doctor

    checks = run_doctor(bandwidth=not no_bandwidth, nproc=nproc)
    if as_json:
        click.echo(json.dumps([c.as_dict() for c in checks], indent=2))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            click.echo(f"{_MARK[c.status]}  {c.name:<{width}}  {c.detail}")
        counts = {s: sum(c.status == s for c in checks) for s in _MARK}
        click.echo(f"{counts['pass']} pass, {counts['warn']} warn, {counts['fail']} fail, {counts['skip']} not checked")
    sys.exit(1 if any(c.status == "fail" for c in checks) else 0)
