"""`scaletrain report RUN_DIR`: the run's self-contained HTML report with plots and the bottleneck diagnosis."""

from __future__ import annotations

from pathlib import Path

import click

from scaletrain.cli.errors import fail


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    default=None,
    help="HTML file to write (default: RUN_DIR/report.html).",
)
def report(run_dir: Path, output: Path | None) -> None:
    """Write RUN_DIR's HTML report (loss, throughput, MFU, memory, step breakdown, device samples, diagnosis)."""
    from scaletrain.monitor.report import write_report

    if not (run_dir / "metrics.jsonl").is_file():
        fail(
            f"RUN_DIR: {run_dir} has no metrics.jsonl; pass a folder written by `scaletrain train` "
            f"(output_dir/run name, e.g. runs/default)"
        )
    click.echo(str(write_report(run_dir, output)))
