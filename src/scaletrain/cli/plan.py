"""`scaletrain plan` and `scaletrain bench`: thin wrappers over scaletrain.plan and scaletrain.hardware."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import click
from click.core import ParameterSource

from scaletrain.cli.errors import fail
from scaletrain.cli.nodes import check_node_flags, endpoint_message, node_options

# Input ranges: beyond them an answer means nothing, and the search (divisors of --gpus, one row per layout)
# would take minutes instead of well under a second.
PLAN_RANGES = {
    "--params": (1e8, 1e15, "1,000 T parameters, ~500x the largest trained models"),
    "--gpus": (1, 65536, "the most GPUs the planner's smallest-setup search tries"),
    "--gpus-per-node": (1, 65536, "at most --gpus"),
    "--seq-len": (2, 2**24, "16.8M tokens, beyond the longest trained contexts"),
    "--global-batch": (1, 2**24, "16.8M sequences, ~1000x the largest published batches"),
    "--dim": (1, 2**24, "a model dimension"),
    "--layers": (1, 1024, "~8x the deepest trained models (126 layers)"),
    "--heads": (1, 2**24, "a model dimension"),
    "--kv-heads": (1, 2**24, "a model dimension"),
    "--ffn-dim": (1, 2**24, "a model dimension"),
    "--vocab": (1, 2**24, "a model dimension"),
    "--top": (1, 1000, "rows in a table a person reads"),
    "--tokens": (1, 2**63 - 1, "a token count that fits in int64"),
}


def _in_range(flag: str, value: float | None) -> None:
    """One line naming the flag and its range when `value` is outside PLAN_RANGES[flag] or not finite."""
    if value is None:
        return
    lo, hi, why = PLAN_RANGES[flag]
    if not math.isfinite(value) or not lo <= value <= hi:
        show = (lambda x: f"{x:,}") if isinstance(hi, int) else (lambda x: f"{x:g}")
        fail(f"{flag}: must be {show(lo)} to {show(hi)} ({why}); got {show(value)}")


def _number(text: str | None, flag: str) -> float | None:
    """'8e9', '8B', '15T', '500M' -> float."""
    if text is None:
        return None
    t = text.strip().upper().replace("_", "")
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(t[-1:], 1.0)
    try:
        value = float(t[:-1] if scale != 1.0 else t) * scale
    except ValueError:
        fail(f"{flag}: expected a number such as 8e9, 8B or 15T (got {text!r})")
    if not math.isfinite(value):
        fail(f"{flag}: must be a finite number (got {text!r})")
    if value <= 0:
        fail(f"{flag}: must be positive (got {text!r})")
    _in_range(flag, value)
    return value


def _list(text: str | None) -> tuple[str, ...]:
    """Comma-separated values; () when the option was not given."""
    return () if text is None else tuple(p.strip() for p in text.split(",") if p.strip())


def _console():
    from rich.console import Console

    width = None if sys.stdout.isatty() else 200
    return Console(width=width, highlight=False, soft_wrap=False)


def _hf_shape(path: str):
    """(decoder shape, name) of a Hugging Face folder's architecture; the spec's one-line summary on stderr."""
    from scaletrain.models.registry import families

    try:
        spec = families()["hf"].from_folder(path)  # type: ignore[attr-defined]
    except ValueError as e:
        fail(str(e).replace("model.hf:", "--hf:", 1))
    click.echo(f"scaletrain: {spec.describe()}", err=True)
    return spec.shape(), spec.architecture


def _workload(model, params, dims, seq_len, global_batch, gpus, shape=None, hf_path=None):
    from scaletrain.models import preset_spec, presets
    from scaletrain.plan.layout import Workload
    from scaletrain.plan.shapes import decoder_shape_for_params

    if hf_path is not None:
        args, name = _hf_shape(hf_path)
    elif shape is not None:  # a job config's model
        args, name = shape, model
    elif params is not None:
        args, name = decoder_shape_for_params(params), f"custom-{params / 1e9:.3g}b"
    else:
        if model not in presets() or preset_spec(model).shape() is None:
            fail(f"--model: unknown model {model!r}; choose one of {', '.join(presets())} or pass --params")
        args, name = preset_spec(model).shape(), model
    changes = {k: v for k, v in dims.items() if v is not None}
    if changes and hf_path is not None:
        fail(
            "--hf: the shape comes from the folder's config.json; drop --dim/--layers/--heads/--kv-heads/--ffn-dim/--vocab"
        )
    if changes:  # each already within PLAN_RANGES
        args = dataclasses.replace(args, **changes)
        name += "*"
        try:
            args.check()
        except ValueError as e:
            fail(str(e))
    seq = seq_len if seq_len is not None else min(8192, args.max_seq_len)
    if seq > args.max_seq_len:
        args = dataclasses.replace(args, max_seq_len=seq)
    gb = global_batch if global_batch is not None else max(256, gpus)
    return Workload(name, args, seq, gb)


def _cluster(gpu, gpus, interconnect, gpus_per_node, cluster_file, calibration, usd, pue):
    from scaletrain.hardware import (
        CalibrationError,
        ClusterFileError,
        apply_calibration,
        load_calibration,
        load_cluster,
        make_cluster,
    )

    try:
        if cluster_file:
            cluster = load_cluster(cluster_file, gpus)
            if usd is not None:
                cluster = dataclasses.replace(cluster, usd_per_gpu_hour=usd)
            if pue is not None:
                cluster = dataclasses.replace(cluster, pue=pue)
        else:
            if gpus is None:
                fail("--gpus: required (or pass --cluster FILE.toml)")
            kwargs = {"pue": pue} if pue is not None else {}
            cluster = make_cluster(gpu, gpus, interconnect, gpus_per_node, usd, **kwargs)
        if calibration:
            cluster = apply_calibration(cluster, load_calibration(calibration))
    except (ClusterFileError, CalibrationError, ValueError) as e:
        fail(str(e))
    return cluster


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def _duration(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "-"
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} d"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min"


def _breakdown(row) -> str:
    m = row.memory
    states = m["parameters"] + m["gradients"] + m["optimizer states"]
    act = m["activations"] + m["recompute working set"] + m["output layer + loss"]
    other = row.memory_total - states - act
    return f"states {_gb(states)} · act {_gb(act)} · other {_gb(other)}"


def _print_plan(result, top_lines, alt_lines, advice, budget, pinned=None, evaluated=False) -> None:
    from rich.table import Table

    con = _console()
    w, c = result.work, result.cluster
    a = w.args
    con.print(
        f"[bold]{w.model_name}[/] ({a.num_params() / 1e9:.2f} B params, {a.n_layers} layers, dim {a.dim}) · "
        f"seq {w.seq_len} · global batch {w.global_batch} ({w.tokens_per_step:,} tokens/step)"
    )
    con.print(
        f"{c.gpus} x {c.gpu.name} ({c.memory_bytes / 1e9:.0f} GB) · {c.nodes} node(s) of {c.gpus_per_node} · "
        f"{c.intra_link.name} inside, {c.inter_link.name} between"
        + (f" · {c.calibration_note}" if c.calibration_note else "")
    )
    if evaluated:
        fits = "fits" if result.rows[0].fits else "does NOT fit"
        con.print(f"evaluated the layout the config pins ({', '.join(f'{k}={v}' for k, v in pinned.items())}): {fits}")
    else:
        pins = f" matching {', '.join(f'{k}={v}' for k, v in pinned.items())}" if pinned else ""
        con.print(f"searched {result.searched:,} layouts{pins} in {result.seconds:.2f} s; {result.fitting:,} fit")
    table = Table(show_lines=False)
    cols = ("#", "layout", "mem/GPU GB", "breakdown GB", "step s", "tokens/s", "MFU", "bubble %", "comm %", "fits")
    for col in cols:
        table.add_column(col, justify="left" if col in ("layout", "breakdown GB") else "right", no_wrap=True)
    for i, r in enumerate(result.rows, 1):
        table.add_row(
            str(i),
            r.layout.describe(),
            _gb(r.memory_total),
            _breakdown(r),
            f"{r.step_s:.3g}",
            f"{r.tokens_per_s:,.0f}",
            f"{r.mfu:.1%}",
            f"{r.bubble_share:.1%}",
            f"{r.comm_share:.1%}",
            "yes" if r.fits else "NO",
        )
    con.print(table)
    top = result.rows[0]
    con.print(
        f"[bold]memory of {'#1' if not evaluated else 'this layout'} per GPU[/]: "
        + " · ".join(f"{k} {_gb(v)} GB" for k, v in top.memory.items() if v > 0),
        soft_wrap=True,  # one line, never broken inside a line's name
    )
    con.print(f"[bold]run {'#1' if not evaluated else 'it'} with[/]: " + top.layout.as_overrides())
    con.print("[bold]why #1[/]:" if not evaluated else "[bold]this layout[/]:")
    for line in top_lines:
        con.print(f"  - {line}")
    if evaluated:
        con.print("[bold]nearest layouts that fit, fewest changes first[/]:" + ("" if alt_lines else " none"))
    elif alt_lines:
        con.print("[bold]why not the alternatives[/]:")
    for line in alt_lines:
        con.print(f"  - {line}")
    if advice:
        con.print("[bold]advice[/]:")
    for line in advice:
        con.print(f"  - {line}")
    if budget is not None:
        con.print(
            f"[bold]token budget[/]: {_duration(budget.time_to_train_s)}, {budget.gpu_hours:,.0f} GPU-hours, "
            f"${budget.cost_usd:,.0f}, {budget.energy_kwh:,.0f} kWh (PUE {c.pue}), "
            f"{budget.node_kw:.1f} kW per node, {budget.cluster_kw:.1f} kW in all"
        )


def _print_compare(budgets, tokens, work) -> None:
    from rich.table import Table

    con = _console()
    con.print(
        f"[bold]{work.model_name}[/] · {tokens:.3g} tokens · seq {work.seq_len} · global batch {work.global_batch}"
    )
    table = Table()
    for col in (
        "gpu",
        "gpus",
        "best layout",
        "tokens/s",
        "MFU",
        "time to train",
        "GPU-hours",
        "cost $",
        "energy kWh",
        "kW/node",
        "kW total",
    ):
        table.add_column(col, justify="left" if col in ("gpu", "best layout") else "right", no_wrap=True)
    for b in budgets:
        if not b.fits:
            table.add_row(
                b.gpu,
                str(b.gpus),
                "does not fit",
                "-",
                "-",
                "-",
                "-",
                "-",
                "-",
                f"{b.node_kw:.1f}",
                f"{b.cluster_kw:.1f}",
            )
            continue
        table.add_row(
            b.gpu,
            str(b.gpus),
            b.layout,
            f"{b.tokens_per_s:,.0f}",
            f"{b.mfu:.1%}",
            _duration(b.time_to_train_s),
            f"{b.gpu_hours:,.0f}",
            f"{b.cost_usd:,.0f}",
            f"{b.energy_kwh:,.0f}",
            f"{b.node_kw:.1f}",
            f"{b.cluster_kw:.1f}",
        )
    con.print(table)
    con.print("prices and node overheads are placeholders unless a cluster file or --usd-per-gpu-hour sets them")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("config_args", nargs=-1, metavar="[CONFIG.toml] [section.key=value ...]")
@click.option("--model", default="llama-8b", show_default=True, help="Built-in preset (see `scaletrain models`).")
@click.option("--params", "params_text", default=None, help="Custom Llama-shaped size instead, e.g. 70B or 1e12.")
@click.option(
    "--hf", "hf_path", default=None, help="Plan a local Hugging Face model folder's architecture (its config.json)."
)
@click.option("--dim", type=int, default=None, help="Override the model's hidden size.")
@click.option("--layers", "n_layers", type=int, default=None)
@click.option("--heads", "n_heads", type=int, default=None)
@click.option("--kv-heads", "n_kv_heads", type=int, default=None)
@click.option("--ffn-dim", type=int, default=None)
@click.option("--vocab", "vocab_size", type=int, default=None)
@click.option("--gpus", type=int, default=None, help="Number of GPUs (required without --cluster).")
@click.option("--gpu", default="h100-sxm", show_default=True, help="GPU type from the catalog.")
@click.option("--interconnect", default=None, help="INTRA[,INTER] links, e.g. nvlink4,ib-ndr (default: the GPU's).")
@click.option("--gpus-per-node", type=int, default=None)
@click.option("--cluster", "cluster_file", default=None, help="TOML cluster file (see docs/planner.md).")
@click.option("--calibration", default=None, help="Calibration TOML from `scaletrain bench`.")
@click.option("--seq-len", type=int, default=None, help="Tokens per sequence (default: min(8192, model max)).")
@click.option("--global-batch", type=int, default=None, help="Sequences per optimizer step (default max(256, gpus)).")
@click.option("--precision", "precisions", default="bf16,fp32", show_default=True, help="Compute dtypes to search.")
@click.option(
    "--fp8",
    type=click.Choice(["none", "tensorwise", "rowwise"]),
    default="none",
    show_default=True,
    help="precision.fp8: bf16 layouts run the blocks' matmuls at the GPU's fp8 rate (priced compiled on a GPU, as "
    "the trainer runs fp8 there).",
)
@click.option(
    "--compile/--eager",
    "compiled",
    default=False,
    show_default=True,
    help="parallel.compile: price compiled blocks (fused elementwise ops, no per-op dispatch) or eager ones.",
)
@click.option(
    "--ac",
    "ac_modes",
    default="none,selective,full",
    show_default=True,
    help="Activation checkpointing modes to search.",
)
@click.option("--schedules", default=None, help="Pipeline schedules to search (default: all).")
@click.option("--cp", "cp_text", default=None, help="Context-parallel degrees to search, e.g. 1,2,4 (default: auto).")
@click.option("--top", type=int, default=10, show_default=True, help="Rows in the table.")
@click.option("--tokens", "tokens_text", default=None, help="Token budget for time, cost and energy, e.g. 15T.")
@click.option("--compare-gpus", default=None, help="GPU types to compare for --tokens, e.g. h100-sxm,l40s.")
@click.option("--usd-per-gpu-hour", type=float, default=None)
@click.option("--pue", type=float, default=None, help="Power usage effectiveness (default 1.3, a placeholder).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def plan(
    config_args,
    model,
    params_text,
    hf_path,
    dim,
    n_layers,
    n_heads,
    n_kv_heads,
    ffn_dim,
    vocab_size,
    gpus,
    gpu,
    interconnect,
    gpus_per_node,
    cluster_file,
    calibration,
    seq_len,
    global_batch,
    precisions,
    ac_modes,
    schedules,
    cp_text,
    top,
    tokens_text,
    compare_gpus,
    usd_per_gpu_hour,
    pue,
    fp8,
    compiled,
    as_json,
) -> None:
    """Plan a training job: memory, step time, MFU, bubble and communication of every layout, ranked and
    explained. Example: `scaletrain plan --model llama-8b --gpus 64 --gpu h100-sxm --interconnect nvlink4,ib-ndr`.

    With a job config (`scaletrain plan my.toml parallel.tp=2`), its model, data.seq_len and every layout field it
    sets (parallel.dp_replicate/dp_shard/tp/pp/pp_schedule/activation_checkpoint, train.micro_batch_size,
    train.global_batch_size, precision.dtype) pin the search; when all are set, that one layout is evaluated and
    printed even if it does not fit, with the nearest faster layouts that do."""
    from scaletrain.config.precisions import PRECISION_NAMES
    from scaletrain.plan import SearchOptions
    from scaletrain.plan import compare_gpus as compare
    from scaletrain.plan.layout import AC_MODES
    from scaletrain.plan.pipeline import NO_PIPELINE, schedule_code
    from scaletrain.plan.report import DoesNotFit, compare_dict, plan_report

    params = _number(params_text, "--params")
    tokens = _number(tokens_text, "--tokens")
    for flag, value in (
        ("--gpus", gpus),
        ("--gpus-per-node", gpus_per_node),
        ("--seq-len", seq_len),
        ("--global-batch", global_batch),
        ("--dim", dim),
        ("--layers", n_layers),
        ("--heads", n_heads),
        ("--kv-heads", n_kv_heads),
        ("--ffn-dim", ffn_dim),
        ("--vocab", vocab_size),
        ("--top", top),
    ):
        _in_range(flag, value)
    if pue is not None and not (math.isfinite(pue) and pue >= 1):
        fail(f"--pue: must be a finite number of at least 1.0 (got {pue})")
    if usd_per_gpu_hour is not None and not (math.isfinite(usd_per_gpu_hour) and usd_per_gpu_hour >= 0):
        fail(f"--usd-per-gpu-hour: must be a finite number, not negative (got {usd_per_gpu_hour})")
    precs, acs = _list(precisions), _list(ac_modes)
    for p in precs:
        if p not in PRECISION_NAMES:
            fail(f"--precision: unknown dtype {p!r}; choose from {', '.join(PRECISION_NAMES)}")
    for a in acs:
        if a not in AC_MODES:
            fail(f"--ac: unknown mode {a!r}; choose from {', '.join(AC_MODES)}")
    if not precs or not acs:
        fail("--precision/--ac: give at least one value")
    sched = _list(schedules)
    for name in sched:
        try:
            if schedule_code(name) == NO_PIPELINE:
                raise ValueError(f"--schedules: {name!r} is not a pipeline schedule")
        except ValueError as e:
            fail(str(e))
    cps = None
    if cp_text:
        try:
            cps = tuple(int(x) for x in _list(cp_text))
        except ValueError:
            fail(f"--cp: expected degrees such as 1,2,4 (got {cp_text!r})")
        if any(not 1 <= c <= PLAN_RANGES["--gpus"][1] for c in cps):
            fail(f"--cp: degrees must be 1 to {PLAN_RANGES['--gpus'][1]:,} (got {cp_text!r})")
    opts = SearchOptions(precisions=precs, ac_modes=acs, cp=cps, top=top)
    if sched:
        opts = dataclasses.replace(opts, schedules=sched)

    config = _job_config(config_args) if config_args else None
    shape = None
    if config is not None:
        cfg = config
        from_flags = click.get_current_context().get_parameter_source("model") != ParameterSource.DEFAULT
        if params is None and not from_flags:
            shape, model = _config_shape(cfg), cfg.model.name
        seq_len = seq_len if seq_len is not None else cfg.data.seq_len
        if global_batch is None and "global_batch_size" in cfg.train.model_fields_set:
            global_batch = cfg.train.global_batch_size
        if gpus is None and cluster_file is None:
            gpus = _config_world(cfg)
    cluster = _cluster(gpu, gpus, interconnect, gpus_per_node, cluster_file, calibration, usd_per_gpu_hour, pue)
    try:
        work = _workload(
            model,
            params,
            {
                "dim": dim,
                "n_layers": n_layers,
                "n_heads": n_heads,
                "n_kv_heads": n_kv_heads,
                "ffn_dim": ffn_dim,
                "vocab_size": vocab_size,
            },
            seq_len,
            global_batch,
            cluster.gpus,
            shape,
            hf_path,
        )
        from scaletrain.plan.layout import runs_compiled

        work = dataclasses.replace(work, fp8=fp8, compile=runs_compiled(compiled, fp8, gpu))
    except ValueError as e:
        fail(str(e))
    pins = None
    if config is not None:
        pins = _pins(config, work, cluster.gpus)
        opts = _pinned_options(opts, pins)

    if compare_gpus:
        if tokens is None:
            fail("--compare-gpus: needs a token budget; add --tokens (e.g. --tokens 1T)")
        try:
            budgets = compare(
                work,
                list(_list(compare_gpus)),
                cluster.gpus,
                tokens,
                opts,
                inter_link=cluster.inter_link.name if interconnect and "," in interconnect else None,
                usd_per_gpu_hour=usd_per_gpu_hour,
                pue=pue,
            )
        except ValueError as e:
            fail(str(e).replace("--gpu:", "--compare-gpus:"))
        if not any(b.fits for b in budgets):
            fail(f"{work.model_name} fits on none of {compare_gpus} with {cluster.gpus} GPUs; {budgets[0].note}")
        if as_json:
            click.echo(json.dumps(compare_dict(work, tokens, budgets), indent=2))
        else:
            _print_compare(budgets, tokens, work)
        return

    try:
        if pins is not None and pins.complete:
            from scaletrain.plan.pin import pinned_layout
            from scaletrain.plan.report import evaluate_report

            report = evaluate_report(work, cluster, pinned_layout(pins, work), opts, pins)
        else:
            report = plan_report(work, cluster, opts, tokens)
    except DoesNotFit as e:
        pinned = f" with {', '.join(f'{k}={v}' for k, v in pins.to_dict().items())}" if pins else ""
        fail(f"{e}{pinned}" if not pins else f"no layout{pinned} fits; {e}")
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
        return
    _print_plan(
        report.result,
        report.why,
        report.alternatives,
        report.advice,
        report.budget,
        report.pinned,
        report.evaluated,
    )


def _job_config(config_args):
    """The JobConfig of `[CONFIG.toml] [key=value ...]` (its model_fields_set: the keys the user set); one line on a
    bad config."""
    from scaletrain.config import ConfigError, load_config
    from scaletrain.config.load import split_config_args

    path, overrides = split_config_args(config_args)
    try:
        return load_config(path, overrides)
    except ConfigError as e:
        fail(str(e))


def _config_shape(cfg):
    """The planner's shape of the job config's model; one line when the planner cannot model it."""
    from scaletrain.models.registry import model_spec

    try:
        spec = model_spec(cfg.model)
    except ValueError as e:
        fail(str(e))
    shape = spec.shape()
    if shape is None:
        fail(f"model.name: the planner cannot model the {spec.family} family (no decoder shape)")
    return shape


def _config_world(cfg):
    """GPUs a job config runs on: launch.nproc_per_node x launch.nnodes when set, else the product of the four
    pinned degrees; None when neither says."""
    from scaletrain.plan.pin import pinned_world, pins_from_config

    if "nproc_per_node" in cfg.launch.model_fields_set and cfg.launch.nproc_per_node > 0:
        return cfg.launch.nproc_per_node * cfg.launch.nnodes
    return pinned_world(pins_from_config(cfg, None))


def _pins(cfg, work, world):
    from scaletrain.plan.pin import PinError, check_pins, pins_from_config

    pins = pins_from_config(cfg, world)
    try:
        check_pins(pins, work, world)
    except PinError as e:
        fail(str(e))
    return pins


def _pinned_options(opts, pins):
    """Search options that cover every pinned value (a pinned precision, checkpointing mode, schedule or
    micro-batch is searched even where the flags would not search it)."""
    changes: dict = {"pins": pins}
    if pins.precision is not None:
        changes["precisions"] = (pins.precision,)
    if pins.ac is not None:
        changes["ac_modes"] = (pins.ac,)
    if pins.schedule is not None:
        changes["schedules"] = (pins.schedule,)
    if pins.micro_batch is not None:
        changes["max_micro_batch"] = max(opts.max_micro_batch, pins.micro_batch)
    return dataclasses.replace(opts, **changes)


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
    from scaletrain.hardware.bench import run_bench
    from scaletrain.hardware.calibration import save_calibration
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
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    save_calibration(cal, tmp)
    tmp.replace(out)  # written whole or not at all
    low = min(cal.matmul, key=lambda p: p[3])
    comm = "one rank: no collectives measured"
    if cal.allreduce_busbw and cal.allgather_busbw:
        comm = (
            f"all-reduce busbw {cal.allreduce_busbw / 1e9:,.2f} GB/s + {(cal.allreduce_latency_s or 0) * 1e6:.0f} us "
            f"per step, all-gather {cal.allgather_busbw / 1e9:,.2f} GB/s + "
            f"{(cal.allgather_latency_s or 0) * 1e6:.0f} us{_scatter(cal)} over {cal.ranks} ranks"
        )
    if cal.nodes and cal.internode_allreduce_busbw and cal.internode_allgather_busbw:
        comm += (
            f"; across {cal.nodes} nodes all-reduce busbw {cal.internode_allreduce_busbw / 1e9:,.3f} GB/s + "
            f"{(cal.internode_allreduce_latency_s or 0) * 1e6:.0f} us per step, all-gather "
            f"{cal.internode_allgather_busbw / 1e9:,.3f} GB/s + {(cal.internode_allgather_latency_s or 0) * 1e6:.0f} us"
            f"{_scatter(cal, 'internode_')}"
        )
    click.echo(
        f"{cal.host} ({cal.device}), per rank of {cal.ranks}: matmul {cal.matmul_flops / 1e9:,.1f} GFLOP/s "
        f"({cal.matmul_dtype}; {low[3] / 1e9:,.1f} at {int(low[0])}x{int(low[1])}x{int(low[2])}), copy "
        f"{cal.memory_bw / 1e9:,.1f} GB/s ({cal.copy[0][1] / 1e9:,.1f} at {cal.copy[0][0] / 2**10:,.0f} KiB), "
        f"{(cal.op_overhead_s or 0.0) * 1e6:.1f} us per dispatched op{_attention(cal)}; {comm}{_sharing(cal)} -> {output}"
    )


def _scatter(cal, prefix: str = "") -> str:
    """The reduce-scatter fit (inside a node, or across nodes with prefix "internode_") for bench's summary line."""
    busbw, latency = getattr(cal, f"{prefix}reducescatter_busbw"), getattr(cal, f"{prefix}reducescatter_latency_s")
    if not busbw:
        return ""
    digits = 3 if prefix else 2
    return f", reduce-scatter {busbw / 1e9:,.{digits}f} GB/s + {(latency or 0) * 1e6:.0f} us"


def _attention(cal) -> str:
    """The attention curve's range, and what a real step achieved (CPU), for bench's summary line."""
    if not cal.attention:
        return ""
    lo, hi = min(cal.attention, key=lambda p: p[2]), max(cal.attention, key=lambda p: p[2])
    out = f", attention {lo[2] / 1e9:,.1f}-{hi[2] / 1e9:,.1f} GFLOP/s (seq {int(lo[0])}-{int(hi[0])})"
    if cal.step_pointwise_bw:
        out += f"; in a real step: memory-bound ops {cal.step_pointwise_bw / 1e9:,.1f} GB/s"
    return out


def _bench_nodes(nodes, node_rank, rdzv_endpoint, nproc, matmul_n, max_bytes):
    """`bench --nodes`: this node's part (hardware/internode.py); the calibration on node 0, else None. One line
    for flags that do not go together or nodes that disagree, before any rank starts."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from scaletrain.launch.bench_nodes import run_node_bench

    check_node_flags(nodes, node_rank, rdzv_endpoint, "bench")
    try:
        return run_node_bench(nodes, node_rank, rdzv_endpoint, nproc, max_bytes, matmul_n)
    except ValueError as e:
        fail(endpoint_message(e))
    except ChildFailedError as e:
        rank, failure = min(e.failures.items())
        fail(f"bench across nodes failed on rank {rank} (exit {failure.exitcode}): {failure.message or 'see above'}")


def _sharing(cal) -> str:
    """How the CPU ranks share the host, as bench measured it (empty on GPUs)."""
    if cal.host_cores is None:
        return ""

    def curve(points) -> str:
        return ", ".join(f"+{x * 1e3:.1f} ms after {g * 1e3:.0f} ms" for g, x in points)

    waits, across = curve(cal.collective_amid_compute), curve(cal.internode_collective_amid_compute)
    return (
        f"; {cal.host_cores} cores"
        + (f"; a collective amid compute waits {waits}" if waits else "")
        + (f" (across the nodes {across})" if across else "")
    )
