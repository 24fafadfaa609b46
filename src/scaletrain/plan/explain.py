"""Why the top layout wins and why the obvious alternatives lose, in sentences built from the predictions."""

from __future__ import annotations

import numpy as np

from scaletrain.config.precisions import PRECISION_NAMES
from scaletrain.plan.search import PlanResult, PlanRow
from scaletrain.plan.steptime import TIME_LINES

GB = 1e9


def _gb(x: float) -> str:
    return f"{x / GB:.1f} GB"


def _largest_lines(row: PlanRow, n: int = 3) -> str:
    items = sorted(row.memory.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{k} {_gb(v)}" for k, v in items)


def _link_phrase(result: PlanResult, tp: int) -> str:
    c = result.cluster
    if tp > c.gpus_per_node:
        return (
            f"TP {tp} crosses nodes over {c.inter_link.name} ({c.inter_bw_per_gpu / GB:.0f} GB/s per GPU vs "
            f"{c.intra_bw / GB:.0f} GB/s on {c.intra_link.name} inside a node)"
        )
    return f"TP {tp} stays inside a node on {c.intra_link.name} ({c.intra_bw / GB:.0f} GB/s per GPU)"


def explain_top(result: PlanResult) -> list[str]:
    """Sentences on why the first row is the plan."""
    if not result.rows:
        return []
    top = result.rows[0]
    lay, c = top.layout, result.cluster
    out = [f"{lay.describe()}: {top.step_s:.3g} s per step, {top.tokens_per_s:,.0f} tokens/s, MFU {top.mfu:.0%}."]
    out.append(f"Memory {_gb(top.memory_total)} of {_gb(c.memory_bytes)} per GPU; largest: {_largest_lines(top)}.")
    compute = (top.time["compute"] + top.time["recompute"]) / top.step_s
    dispatch = top.time["op dispatch"] / top.step_s
    host = f", host op dispatch {dispatch:.0%}" if dispatch >= 0.005 else ""
    out.append(
        f"Compute is {compute:.0%} of the step, exposed communication {top.comm_share:.0%}, "
        f"pipeline bubble {top.bubble_share:.0%}{host}."
    )
    if lay.dp_shard > 1 and lay.accumulation > 1 and lay.pp > 1:
        out.append(
            f"torch's pipeline schedule keeps unsharded fp32 gradients while accumulating {lay.accumulation} "
            f"micro-batches ({_gb(top.memory['gradients'])})."
        )
    elif lay.dp_shard > 1 and lay.accumulation > 1:
        out.append(
            f"FSDP2 reduce-scatters each of the {lay.accumulation} micro-batches into sharded fp32 gradients "
            f"({_gb(top.memory['gradients'])}); parallel.fsdp_accumulate=unsharded holds whole ones instead "
            f"(one reduce-scatter per step)."
        )
    if lay.tp > 1:
        out.append(_link_phrase(result, lay.tp) + ".")
    if lay.ac != "none":
        g = result.grid
        same = (
            (g.dp_replicate == lay.dp_replicate)
            & (g.dp_shard == lay.dp_shard)
            & (g.tp == lay.tp)
            & (g.pp == lay.pp)
            & (g.cp == lay.cp)
            & (g.micro_batch == lay.micro_batch)
            & (g.precision == PRECISION_NAMES.index(lay.precision))
            & (g.ac == 0)
        )
        idx = np.flatnonzero(same)
        if len(idx):
            need = float(result.mem_total[idx].min())
            if need > c.memory_bytes:
                out.append(
                    f"Activation checkpointing ({lay.ac}) is needed: without it this layout needs "
                    f"{_gb(need)} > {_gb(c.memory_bytes)}."
                )
            else:
                out.append(
                    f"Activation checkpointing ({lay.ac}) costs {top.time['recompute']:.3g} s of recompute "
                    f"but lets a larger micro-batch or less sharding win overall."
                )
    return out


def _families(result: PlanResult) -> list[tuple[str, np.ndarray]]:
    g, gpn = result.grid, result.cluster.gpus_per_node
    plain = (g.tp == 1) & (g.pp == 1) & (g.cp == 1)
    return [
        ("pure DDP", plain & (g.dp_shard == 1) & (g.dp_replicate > 1)),
        ("FSDP/HSDP without TP or PP", plain & (g.dp_shard > 1)),
        ("TP inside a node", (g.tp > 1) & (g.tp <= gpn)),
        ("TP across nodes", g.tp > gpn),
        ("pipeline parallel", g.pp > 1),
        ("no activation checkpointing", g.ac == 0),
        ("full activation checkpointing", g.ac == 2),
        ("fp32 compute", g.precision == PRECISION_NAMES.index("fp32")),
    ]


def explain_alternatives(result: PlanResult, limit: int = 6) -> list[str]:
    """One sentence per obvious alternative the top layout beats: what it would cost, or why it does not fit."""
    if not result.rows:
        return []
    top = result.rows[0]
    top_i = _top_index(result)
    out = []
    for label, mask in _families(result):
        if mask[top_i] or not mask.any():
            continue
        idx = np.flatnonzero(mask)
        fits = idx[result.mem_total[idx] <= result.cluster.memory_bytes]
        if not len(fits):
            best = result.row_at(int(idx[np.argmin(result.mem_total[idx])]))
            out.append(
                f"{label} ({best.layout.describe()}) does not fit: needs {_gb(best.memory_total)} > "
                f"{_gb(result.cluster.memory_bytes)} ({_largest_lines(best, 2)})."
            )
        else:
            best = result.row_at(int(fits[np.argmin(result.step[fits])]))
            slower = best.step_s / top.step_s - 1
            deltas = sorted(((best.time[k] - top.time[k], k) for k in TIME_LINES), reverse=True)
            why = ", ".join(f"{k} +{d:.3g} s" for d, k in deltas[:2] if d > 0.01 * top.step_s) or "similar"
            extra = f"; {_link_phrase(result, best.layout.tp)}" if "TP" in label else ""
            out.append(f"{label} ({best.layout.describe()}): {slower:+.0%} step time ({why}){extra}.")
        if len(out) >= limit:
            break
    return out


def _top_index(result: PlanResult) -> int:
    fits = np.flatnonzero(result.mem_total <= result.cluster.memory_bytes)
    return int(fits[np.argmin(result.step[fits])])
