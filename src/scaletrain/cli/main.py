"""The `scaletrain` command. Thin: parse, check, call the packages. Bad input: one line on stderr, exit 2.

Answers fast: this module and the command modules import click and stdlib only at the top; each command imports
what it needs (torch, pydantic, numpy, rich) when it runs, so `scaletrain --help` never loads torch.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from scaletrain.cli.ckpt import ckpt
from scaletrain.cli.data import data
from scaletrain.cli.doctor import doctor
from scaletrain.cli.errors import fail
from scaletrain.cli.eval import eval_cmd
from scaletrain.cli.generate import generate
from scaletrain.cli.launch import launch
from scaletrain.cli.bench import bench
from scaletrain.cli.plan import plan
from scaletrain.cli.report import report
from scaletrain.config.errors import ConfigError
from scaletrain.exit_codes import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_HANG, EXIT_REQUEUE

if TYPE_CHECKING:
    from scaletrain.config import JobConfig


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="scaletrain")
def main() -> None:
    """Plan, check, launch, train, recover and monitor multi-GPU PyTorch training."""


@main.command(context_settings={"ignore_unknown_options": False})
@click.argument("args", nargs=-1)
@click.option("--print-config", is_flag=True, help="Print the resolved config as TOML and exit.")
@click.option(
    "--nproc-per-node",
    type=click.IntRange(min=1),
    default=None,
    help="Local ranks (default: launch.nproc_per_node; 0 there means all GPUs, or 2 CPU ranks).",
)
@click.option(
    "--plan",
    "plan_mode",
    default=None,
    metavar="auto",
    help="auto: run the planner's fastest layout for this model, batch and the local ranks "
    "(key=value overrides still win).",
)
@click.option("--calibration", default=None, help="With --plan auto: calibration TOML from `scaletrain bench`.")
@click.option(
    "--nnodes",
    default=None,
    metavar="N|MIN:MAX",
    help="Nodes, one `scaletrain train` agent each (launch.nnodes); MIN:MAX is elastic: after a lost node the "
    "run goes on with as few as MIN (launch.min_nodes).",
)
@click.option(
    "--node-rank",
    type=click.IntRange(min=0),
    default=None,
    help="This node's number, checked at the rendezvous: two nodes with the same one are refused (launch.node_rank).",
)
@click.option("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="The c10d rendezvous (launch.rdzv_endpoint).")
def train(
    args: tuple[str, ...],
    print_config: bool,
    nproc_per_node: int | None,
    plan_mode: str | None,
    calibration: str | None,
    nnodes: str | None,
    node_rank: int | None,
    rdzv_endpoint: str | None,
) -> None:
    """Train: `scaletrain train [CONFIG.toml] [section.key=value ...]`.

    With no arguments, trains the built-in tiny Llama-style model on this Python's standard library sources
    (byte tokens) on 2 local CPU ranks over gloo, or on every local GPU with NCCL.
    Under an external `torchrun`, runs as the rank it was started as.
    """
    from scaletrain.config import load_config, split_config_args, to_toml
    from scaletrain.parallel.rank_env import under_external_launcher
    from scaletrain.resolve import default_nproc, resolve_job, settle_device_defaults

    path, overrides = split_config_args(args)
    overrides = [*overrides, *_node_overrides(nnodes, node_rank, rdzv_endpoint)]
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        fail(str(e))
    if plan_mode is not None or calibration is not None:
        cfg = _planned(path, overrides, cfg, plan_mode, calibration, nproc_per_node)
    if print_config:
        click.echo(to_toml(cfg), nl=False)
        return

    if under_external_launcher():
        from scaletrain.train.worker import run

        run(cfg)
        return

    nproc = nproc_per_node or cfg.launch.nproc_per_node or default_nproc(cfg.run.device)
    world = nproc * cfg.launch.nnodes
    try:
        from scaletrain.parallel.float8 import check_float8_device
        from scaletrain.parallel.runtime import pick_device_type

        device_type = pick_device_type(cfg.run.device)
        check_float8_device(cfg.precision.fp8, device_type)
        cfg = settle_device_defaults(cfg, device_type)  # the ranks start on this host: decide "auto" here, once
        resolve_job(cfg, world)
        from scaletrain.config.folders import check_writable_folder

        check_writable_folder(cfg.run_dir(), "run.output_dir")
        if cfg.checkpoint.dir:
            check_writable_folder(cfg.checkpoint.dir, "checkpoint.dir")
        if cfg.launch.nnodes > 1 and cfg.launch.rdzv_endpoint.endswith(":0"):
            raise ValueError("launch.rdzv_endpoint: a multi-node run needs a fixed host:port every node can reach")
        from scaletrain.launch.local import check_agent_supports, open_rendezvous

        check_agent_supports(cfg.launch)
        rdzv = open_rendezvous(cfg.launch)  # binds the rendezvous store: a taken port fails here, not in a rank
    except ValueError as e:
        fail(str(e))

    if cfg.launch.restart == "in-process":
        _train_in_process(cfg, nproc, rdzv)
        return
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    from scaletrain.launch.local import launch_local
    from scaletrain.monitor.rank_logs import failure_line, quiet_agent_failures

    try:
        with quiet_agent_failures(cfg.run_dir(), cfg.launch.max_restarts, cfg.launch.nnodes) as failures:
            launch_local(cfg, nproc, rdzv)
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        if codes == {EXIT_BAD_INPUT}:  # the ranks refused the job (a node differs): their one line is the error
            from scaletrain.monitor.rank_logs import failure_cause, rank_log

            rank = min(e.failures)
            fail(failure_cause(rank_log(cfg.run_dir(), rank), rank) or "the ranks refused the job")
        if codes == {EXIT_REQUEUE}:
            click.echo(
                f"scaletrain: preempted; a checkpoint was saved, the same command resumes it (exit {EXIT_REQUEUE})",
                err=True,
            )
            sys.exit(EXIT_REQUEUE)
        # the watchdog's rank holds the diagnosis; the frozen rank it killed may have been noticed first
        rank, first = min(e.failures.items(), key=lambda kv: (kv[1].exitcode != EXIT_HANG, kv[1].timestamp))
        code = first.exitcode
        if code != EXIT_HANG and failures.killed is not None and cfg.launch.nnodes == 1:
            rank, code = failures.killed  # a SIGKILLed rank, whose peers then failed on it
        click.echo(f"scaletrain: training failed on {failure_line(cfg.run_dir(), rank, code)}", err=True)
        sys.exit(EXIT_FAILED)
    except SignalException as e:
        # the agent was told to stop (scheduler preemption): it sent SIGTERM to the workers, which saved
        click.echo(
            f"scaletrain: stopped by {e.sigval.name}; workers checkpoint before exiting, the same command "
            f"resumes (exit {EXIT_REQUEUE})",
            err=True,
        )
        sys.exit(EXIT_REQUEUE)
    except RendezvousError as e:
        # another node's agent serves the rendezvous store; it went away (that node ended or is unreachable)
        click.echo(
            f"scaletrain: lost the rendezvous at {rdzv.endpoint} ({type(e).__name__}): the node serving it "
            f"(launch.rdzv_endpoint) ended or became unreachable; its output says why; this node's ranks were stopped",
            err=True,
        )
        sys.exit(EXIT_FAILED)


def _train_in_process(cfg: JobConfig, nproc: int, rdzv) -> None:
    """launch.restart=in-process: the ranks and their warm spares under launch/inprocess.py's launcher."""
    from scaletrain.launch.inprocess import RankFailed, launch_in_process
    from scaletrain.monitor.rank_logs import failure_line

    try:
        launch_in_process(cfg, nproc, rdzv)
    except RankFailed as e:
        if e.exitcode == EXIT_REQUEUE:
            click.echo(
                f"scaletrain: preempted; a checkpoint was saved, the same command resumes it (exit {EXIT_REQUEUE})",
                err=True,
            )
            sys.exit(EXIT_REQUEUE)
        click.echo(f"scaletrain: training failed on {failure_line(cfg.run_dir(), e.rank, e.exitcode)}", err=True)
        sys.exit(EXIT_FAILED)


def _node_overrides(nnodes: str | None, node_rank: int | None, rdzv_endpoint: str | None) -> list[str]:
    """--nnodes/--node-rank/--rdzv-endpoint as the launch.* overrides they stand for (after the user's own)."""
    out = []
    if nnodes is not None:
        lo, sep, hi = nnodes.partition(":")
        if not (lo.isdigit() and (not sep or hi.isdigit())):
            fail(f"--nnodes: '{nnodes}' is not N or MIN:MAX (e.g. 2 or 1:2)")
        out += [f"launch.nnodes={hi or lo}", f"launch.min_nodes={lo if sep else 0}"]
    if node_rank is not None:
        out.append(f"launch.node_rank={node_rank}")
    if rdzv_endpoint is not None:
        out.append(f"launch.rdzv_endpoint={rdzv_endpoint}")
    return out


def _planned(path, overrides, cfg, plan_mode, calibration, nproc_per_node) -> JobConfig:
    """`--plan auto`: the job's config with the planner's layout for the local ranks applied (the user's own
    settings kept); prints the choice."""
    import os

    from scaletrain.hardware import CalibrationError, detect_host
    from scaletrain.plan.auto import PLAN_CHOICES, auto_plan
    from scaletrain.parallel.rank_env import under_external_launcher
    from scaletrain.resolve import default_nproc

    if plan_mode not in PLAN_CHOICES:
        fail(
            f"--plan: unknown mode {plan_mode!r}; the only mode is auto"
            if plan_mode is not None
            else "--calibration: only used with --plan auto; add --plan auto"
        )
    if under_external_launcher():
        nproc = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        nnodes = max(1, int(os.environ.get("WORLD_SIZE", "1")) // nproc)
    else:
        nproc = nproc_per_node or cfg.launch.nproc_per_node or default_nproc(cfg.run.device)
        nnodes = cfg.launch.nnodes
    gpu = "cpu" if cfg.run.device == "cpu" else detect_host().catalog_gpu
    if gpu == "unknown":
        fail(
            "--plan auto: this host's GPU is not in the planner's catalog; run `scaletrain plan` with a cluster "
            "file instead"
        )
    try:
        chosen = auto_plan(path, overrides, nproc, nnodes, gpu, calibration)
    except (ValueError, CalibrationError, ConfigError) as e:
        fail(str(e))
    click.echo(f"scaletrain: {chosen.summary()}", err=True)
    return chosen.config


@main.command()
def models() -> None:
    """List the built-in model presets with their sizes."""
    from scaletrain.models import preset_spec, presets

    for name in presets():
        spec = preset_spec(name)
        a = spec.shape()
        shape = (
            (
                f"dim {a.dim:5d}  layers {a.n_layers:3d}  heads {a.n_heads:3d}/{a.n_kv_heads:<2d} kv  "
                f"vocab {a.vocab_size}"
            )
            if a is not None
            else f"{spec.args}"
        )
        try:
            size = f"{spec.num_params() / 1e9:9.3f} B params"
        except ValueError:  # a shape the data completes (a recommender's tables)
            size = f"{'data':>9s} B params"
        click.echo(f"{name:12s} {size}  {shape}  ({spec.family})")
    from scaletrain.models.hf.tp import HF_SUPPORT

    click.echo(HF_SUPPORT)


main.add_command(plan)
main.add_command(bench)
main.add_command(ckpt)
main.add_command(launch)
main.add_command(doctor)
main.add_command(report)
main.add_command(data)
main.add_command(generate)
main.add_command(eval_cmd)

if __name__ == "__main__":
    main()
