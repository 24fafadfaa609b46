"""`scaletrain bench`: measure this host's (and with --nodes, the nodes') efficiency curves into a calibration TOML
for `scaletrain plan --calibration` (launch/bench_local.py, launch/bench_nodes.py)."""

from __future__ import annotations

from pathlib import Path

import click

from scaletrain.cli.errors import fail
from scaletrain.cli.nodes import check_node_flags, node_options


@click.command()
@click.option("--output", "-o", default="calibration.toml", show_default=True, help="Calibration TOML to write.")
@click.option(
    "--nproc",
    type=int,
    default=None,
    help="Local ranks to measure over, as `scaletrain train --nproc-per-node` would start [default: one per GPU, "
    "else 2]; 1 skips the collectives.",
)
@click.option("--size-mb", type=float, default=16.0, show_default=True, help="Largest collective message, MiB.")
@click.option("--matmul-n", type=int, default=None, help="Largest square matmul [default: 8192 on a GPU, else 1024].")
@node_options(
    "Nodes, one `scaletrain bench` each (as `train --nnodes`): also measure all-reduce, all-gather and "
    "reduce-scatter across them and inside each node with all running; node 0 writes the file."
)
def bench(output, nproc, size_mb, matmul_n, nodes, node_rank, rdzv_endpoint) -> None:
    """Measure this host's efficiency curves: matmul FLOP/s at several GEMM shapes, copy bandwidth at several sizes,
    causal attention forward + backward at several sequence lengths and head dims, host time per dispatched op,
    all-reduce and all-gather latency + bandwidth between local ranks (on a CPU also its usable cores, a
    collective's extra wait amid compute, and a real training step timed op by op); write a calibration TOML for
    `scaletrain plan --calibration FILE`. With `--nodes N --node-rank K --rdzv-endpoint HOST:PORT` on each of N
    nodes, also across the nodes (the planner prices collectives spanning nodes with it)."""
    from scaletrain.launch.bench_local import run_bench
    from scaletrain.hardware.calibration import calibration_summary, save_calibration
    from scaletrain.hardware.detect import detect_host

    if nproc is not None and nproc < 1:
        fail(f"--nproc: at least 1 rank (got {nproc})")
    if not size_mb > 0 or size_mb > 4096:
        fail(f"--size-mb: between 0 and 4096 MiB (got {size_mb})")
    if matmul_n is not None and not 16 <= matmul_n <= 65536:
        fail(f"--matmul-n: between 16 and 65536 (got {matmul_n})")
    out = Path(output)
    if out.exists() and out.is_dir():
        fail(f"--output: {output!r} is a folder; give a file name")
    if not out.parent.exists():
        fail(f"--output: folder {str(out.parent)!r} does not exist")
    nproc = nproc or max(detect_host().gpu_count, 2)
    if nodes > 1 or node_rank is not None or rdzv_endpoint is not None:
        cal = _bench_nodes(nodes, node_rank, rdzv_endpoint, nproc, matmul_n, max(1024, int(size_mb * 2**20)))
        if cal is None:
            click.echo(f"node {node_rank}: measured; node 0 writes {output}")
            return
    else:
        cal = run_bench(nproc=nproc, matmul_n=matmul_n, collective_bytes=max(1024, int(size_mb * 2**20)))
    save_calibration(cal, out)
    click.echo(f"{calibration_summary(cal)} -> {output}")


def _bench_nodes(nodes, node_rank, rdzv_endpoint, nproc, matmul_n, max_bytes):
    """`bench --nodes`: this node's part (hardware/internode.py); the calibration on node 0, else None. One line
    for flags that do not go together or nodes that disagree, before any rank starts."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from scaletrain.launch.bench_nodes import run_node_bench

    check_node_flags(nodes, node_rank, rdzv_endpoint, "bench")
    try:
        return run_node_bench(nodes, node_rank, rdzv_endpoint, nproc, max_bytes, matmul_n)
    except ValueError as e:
        fail(str(e))
    except ChildFailedError as e:
        rank, failure = min(e.failures.items())
        fail(f"bench across nodes failed on rank {rank} (exit {failure.exitcode}): {failure.message or 'see above'}")
