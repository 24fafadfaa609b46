"""The planner's answers as `scaletrain plan` prints them: rich tables and lines, beside the data they render
(report.py's PlanReport, advice.py's Budget); `--json` prints their to_dict() instead."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from scaletrain.plan.advice import Budget
from scaletrain.plan.layout import Workload
from scaletrain.plan.report import PlanReport

if TYPE_CHECKING:
    from scaletrain.plan.traced import TracedPlan


def console():
    """A rich console: the terminal's width, or 200 columns when the output is not a terminal."""
    from rich.console import Console

    width = None if sys.stdout.isatty() else 200
    return Console(width=width, highlight=False, soft_wrap=False)


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def _size(x: float) -> str:
    """Bytes in GB, or MB below 0.1 GB (a small model's lines)."""
    return f"{x / 1e9:.1f} GB" if x >= 1e8 else f"{x / 1e6:.3g} MB"


def _seconds(x: float) -> str:
    return f"{x:.3g} s" if x >= 1 else f"{x * 1e3:.3g} ms"


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


def print_plan(report: PlanReport) -> None:
    """The report as `scaletrain plan` prints it: the workload and cluster, the ranked layouts as a table, the first
    one's memory, how to run it, why it and why not the others, advice and the token budget."""
    from rich.table import Table

    result, top_lines, alt_lines, advice = report.result, report.why, report.alternatives, report.advice
    budget, pinned, evaluated = report.budget, report.pinned, report.evaluated

    con = console()
    w, c = result.work, result.cluster
    a = w.args
    con.print(
        f"[bold]{w.model_name}[/] ({a.num_params() / 1e9:.2f} B params, {a.n_layers} layers, dim {a.dim}) · "
        f"seq {w.seq_len}{f' (packed documents of {w.doc_len})' if w.doc_len else ''} · global batch "
        f"{w.global_batch} ({w.tokens_per_step:,} tokens/step)"
    )
    if w.lora is not None:
        from scaletrain.plan.lora import adapter_params

        adapters = adapter_params(a, w.lora)
        con.print(
            f"{w.lora.describe()}: {adapters / 1e6:.2f} M adapter params ({adapters / a.num_params():.2%} of the "
            f"base) get gradients and optimizer states; the base is frozen"
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


def print_compare(budgets: list[Budget], tokens: float, work: Workload) -> None:
    """One token budget across GPU types (advice.compare_gpus) as a table."""
    from rich.table import Table

    con = console()
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


def print_traced_plan(plan: TracedPlan) -> None:
    """A plan made from a model's trace (plan/traced.py): the model as traced, the ranked layouts, and for the first
    what dominates its memory and its step time, line by line, and the operators that weigh most."""
    from rich.table import Table

    from scaletrain.plan.trace import describe

    con = console()
    c = plan.cluster
    for trace in plan.traces.values():
        con.print(f"[bold]traced[/] ({trace.dtype}): {describe(trace)}", soft_wrap=True)
    con.print(
        f"{c.gpus} x {c.gpu.name} ({c.memory_bytes / 1e9:.0f} GB) · global batch {plan.global_batch} samples · "
        f"searched {plan.searched} data-parallel layouts in {plan.seconds:.2f} s"
    )
    table = Table(show_lines=False)
    for col in ("#", "layout", "mem/rank", "step s", "samples/s", "dominant memory", "dominant time", "fits"):
        table.add_column(col, justify="left" if col in ("layout", "dominant memory", "dominant time") else "right")
    for i, r in enumerate(plan.rows, 1):
        mem, mem_share, tim, tim_share = r.dominant()
        table.add_row(
            str(i),
            r.layout.describe(),
            _size(r.memory_total),
            f"{r.step_s:.3g}",
            f"{plan.global_batch / r.step_s:,.1f}",
            f"{mem} {mem_share:.0%}",
            f"{tim} {tim_share:.0%}",
            "yes" if r.fits else "NO",
        )
    con.print(table)
    top = plan.rows[0]
    mem, mem_share, tim, tim_share = top.dominant()
    con.print(
        "[bold]memory of #1 per rank[/]: "
        + " · ".join(f"{k} {_size(v)}" for k, v in top.memory.items() if v > 0)
        + f"; dominated by {mem} ({mem_share:.0%})",
        soft_wrap=True,
    )
    con.print(
        "[bold]step of #1[/]: "
        + " · ".join(f"{k} {_seconds(v)}" for k, v in top.time.items() if v > 0)
        + f"; dominated by {tim} ({tim_share:.0%})",
        soft_wrap=True,
    )
    trace = plan.traces[top.layout.precision]
    total = trace.flops() or 1.0
    moved = trace.bytes_moved() or 1.0
    con.print("[bold]heaviest operators of one micro-batch[/] (FLOPs share, bytes share):")
    for where, op, flops, nbytes in trace.top_ops():
        con.print(f"  - {op} in {where}: {flops / total:.0%} of FLOPs, {nbytes / moved:.0%} of bytes moved")
    for line in plan.advice:
        con.print(f"[bold]the change that helps most[/]: {line}")
    if not top.fits:
        con.print(f"[bold]nothing fits[/] in {c.memory_bytes / 1e9:.0f} GB per rank; the leanest needs above")
    con.print(f"[bold]run #1 with[/]: {top.layout.as_overrides()}")
