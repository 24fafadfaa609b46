"""Calibration files: figures `scaletrain bench` measured on a host, used by the planner instead of datasheets.

Besides one figure per resource (the best matmul rate, the large-copy bandwidth, the all-reduce bus bandwidth), a
file holds the measured curves the planner interpolates between (plan/efficiency.py): matmul FLOP/s at several GEMM
shapes, copy bandwidth at several sizes, and all-reduce / all-gather seconds at several message sizes with their
latency + bandwidth fit.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

import tomli_w

from scaletrain.hardware.cluster import Cluster
from scaletrain.config.toml_file import read_toml


class CalibrationError(ValueError):
    """A calibration file is missing, malformed or from another device; one line."""


# the measured points a file may hold, as TOML arrays of tables: name -> the keys of one point
POINT_KEYS: dict[str, tuple[str, ...]] = {
    "matmul": ("m", "n", "k", "flops"),  # [m x k] @ [k x n] at `flops` FLOP/s
    "copy": ("bytes", "bandwidth"),  # a copy of `bytes` at `bandwidth` bytes/s, read + write counted
    "all_reduce": ("bytes", "seconds"),  # one collective of `bytes` (the full message per rank), seconds
    "all_gather": ("bytes", "seconds"),  # `bytes`: the gathered output
    "reduce_scatter": ("bytes", "seconds"),  # `bytes`: the full input each rank reduces (files before it: none)
    # the same, over every rank of every node (`scaletrain bench --nodes N`)
    "internode_all_reduce": ("bytes", "seconds"),
    "internode_all_gather": ("bytes", "seconds"),
    "internode_reduce_scatter": ("bytes", "seconds"),
    # CPU: an all-gather over every rank of every node after compute on each, as collective_amid_compute
    "internode_collective_amid_compute": ("gap_s", "extra_s"),
    # CPU: seconds of compute between two collectives, and what one all-gather then costs beyond it and its own time
    "collective_amid_compute": ("gap_s", "extra_s"),
    # causal scaled_dot_product_attention, forward + backward, at `flops` FLOP/s (3 x the forward's 2 s^2 d per head)
    "attention": ("seq", "head_dim", "flops"),
    # CPU: measured op by op inside a real training step (bench's step_profile): its GEMMs and its attention
    "step_matmul": ("m", "n", "k", "flops"),
    "step_attention": ("seq", "head_dim", "flops"),
}


@dataclass(frozen=True)
class Calibration:
    device: str  # catalog name of what was measured ("cpu" on a CPU host)
    host: str
    ranks: int
    matmul_flops: float  # achieved FLOP/s of the fastest measured matmul in `matmul_dtype`
    matmul_dtype: str
    memory_bw: float  # bytes/s of the largest measured copy (read + write)
    allreduce_busbw: float | None  # bytes/s, nccl-tests convention: algbw x 2(n-1)/n (None: one rank, not measured)
    memory_bytes: float | None  # device memory (host RAM on a CPU host), bytes
    torch_version: str
    op_overhead_s: float | None = None  # host seconds per dispatched op of the built-in block (older files: none)
    allreduce_latency_s: float | None = None  # fitted latency per ring step, seconds
    allgather_busbw: float | None = None  # bytes/s, algbw x (n-1)/n
    allgather_latency_s: float | None = None
    # gloo's reduce-scatter costs about an all-reduce (4 CPU ranks: 8.1 ms where an all-gather of the same
    # message takes 4.9), so it is measured, not taken as an all-gather; files before it: none (all-gather's used)
    reducescatter_busbw: float | None = None  # bytes/s, algbw x (n-1)/n
    reducescatter_latency_s: float | None = None
    # measured points, tuples in POINT_KEYS order (files written before the curves: empty)
    matmul: tuple[tuple[float, ...], ...] = ()
    copy: tuple[tuple[float, ...], ...] = ()
    all_reduce: tuple[tuple[float, ...], ...] = ()
    all_gather: tuple[tuple[float, ...], ...] = ()
    reduce_scatter: tuple[tuple[float, ...], ...] = ()
    # measured by `scaletrain bench --nodes N` (hardware/internode.py; one node: none): one ring over the `ranks`
    # ranks of each of `nodes` nodes, so every node's link carries one stream of it; busbw and latency per ring
    # step as above. The figures above are then those inside one node, measured at the same time on every node.
    nodes: int | None = None
    internode_allreduce_busbw: float | None = None
    internode_allreduce_latency_s: float | None = None
    internode_allgather_busbw: float | None = None
    internode_allgather_latency_s: float | None = None
    internode_reducescatter_busbw: float | None = None
    internode_reducescatter_latency_s: float | None = None
    internode_all_reduce: tuple[tuple[float, ...], ...] = ()
    internode_all_gather: tuple[tuple[float, ...], ...] = ()
    internode_reduce_scatter: tuple[tuple[float, ...], ...] = ()
    internode_collective_amid_compute: tuple[tuple[float, ...], ...] = ()
    # the host's CPU sharing (bench on a CPU; None on GPUs and in older files): the cores the ranks may run on
    # (os.sched_getaffinity), and the extra wait of a collective amid compute over `ranks` ranks (POINT_KEYS)
    host_cores: int | None = None
    collective_amid_compute: tuple[tuple[float, ...], ...] = ()
    # causal attention forward + backward (POINT_KEYS); files written before it: empty
    attention: tuple[tuple[float, ...], ...] = ()
    # CPU: one real forward + backward of the built-in model measured op by op (hardware/op_profile.py step_profile):
    # what its GEMMs and attention achieved there (cold operands, fresh outputs, cores shared as in training), and
    # the bytes/s of its memory-bound ops (norms, activations, RoPE, residual adds, the loss)
    step_matmul: tuple[tuple[float, ...], ...] = ()
    step_attention: tuple[tuple[float, ...], ...] = ()
    step_pointwise_bw: float | None = None

    def to_toml(self) -> str:
        body = {k: v for k, v in dataclasses.asdict(self).items() if v is not None and k not in POINT_KEYS} | {
            name: [dict(zip(keys, p)) for p in getattr(self, name)] for name, keys in POINT_KEYS.items()
        }
        return "# written by `scaletrain bench`; pass to `scaletrain plan --calibration`\n" + tomli_w.dumps(
            {k: v for k, v in body.items() if v != []}
        )


def save_calibration(cal: Calibration, path: str | Path) -> None:
    """Write `cal` as TOML to `path`, whole or not at all (a temporary file beside it, then renamed)."""
    out = Path(path)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.write_text(cal.to_toml())
    tmp.replace(out)


def calibration_summary(cal: Calibration) -> str:
    """One line of what `scaletrain bench` measured: per-rank matmul, copy, dispatch and attention rates, the
    collectives' fits inside the host and across nodes, and (CPU) how the ranks share the cores."""
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
    return (
        f"{cal.host} ({cal.device}), per rank of {cal.ranks}: matmul {cal.matmul_flops / 1e9:,.1f} GFLOP/s "
        f"({cal.matmul_dtype}; {low[3] / 1e9:,.1f} at {int(low[0])}x{int(low[1])}x{int(low[2])}), copy "
        f"{cal.memory_bw / 1e9:,.1f} GB/s ({cal.copy[0][1] / 1e9:,.1f} at {cal.copy[0][0] / 2**10:,.0f} KiB), "
        f"{(cal.op_overhead_s or 0.0) * 1e6:.1f} us per dispatched op{_attention(cal)}; {comm}{_sharing(cal)}"
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


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _points(tree: dict, name: str, where: str) -> tuple[tuple[float, ...], ...]:
    keys = POINT_KEYS[name]
    rows = tree.get(name, [])
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise CalibrationError(f"{where}: {name}: must be a list of [[{name}]] tables with keys {', '.join(keys)}")
    out = []
    for i, row in enumerate(rows):
        if set(row) != set(keys):
            raise CalibrationError(f"{where}: {name}[{i}]: needs exactly the keys {', '.join(keys)}")
        bad = next((k for k in keys if not _positive(row[k])), None)
        if bad:
            raise CalibrationError(f"{where}: {name}[{i}].{bad}: must be a positive number (got {row[bad]!r})")
        out.append(tuple(float(row[k]) for k in keys))
    return tuple(out)


def load_calibration(path: str | Path) -> Calibration:
    """Read a calibration TOML; CalibrationError names the problem."""
    p = Path(path)
    where = f"calibration file {str(p)!r}"
    tree = read_toml(p, "calibration file", CalibrationError, f"write one with `scaletrain bench --output {p}`")
    names = {f.name: f for f in dataclasses.fields(Calibration)}
    unknown = sorted(set(tree) - set(names))
    if unknown:
        raise CalibrationError(f"{where}: {unknown[0]}: unknown key; valid keys: {', '.join(names)}")
    required = ("device", "host", "ranks", "matmul_flops", "matmul_dtype", "memory_bw", "torch_version")
    missing = [n for n in required if n not in tree]
    if missing:
        raise CalibrationError(f"{where}: {missing[0]}: missing; rerun `scaletrain bench`")
    figures = ("matmul_flops", "memory_bw", "allreduce_busbw", "op_overhead_s", "allreduce_latency_s")
    kinds = ("allreduce", "allgather", "reducescatter")
    internode = ("nodes", *(f"internode_{c}_{f}" for c in kinds for f in ("busbw", "latency_s")))
    intra = (f"{c}_{f}" for c in kinds[1:] for f in ("busbw", "latency_s"))
    for key in (*figures, *intra, "step_pointwise_bw", *internode):
        if key in tree and not _positive(tree[key]) and not (key.endswith("latency_s") and tree[key] == 0):
            raise CalibrationError(f"{where}: {key}: must be a positive number (got {tree[key]!r})")
    cores = tree.get("host_cores")
    if cores is not None and (not isinstance(cores, int) or isinstance(cores, bool) or cores < 1):
        raise CalibrationError(f"{where}: host_cores: must be a whole number of cores, at least 1 (got {cores!r})")
    points = {name: _points(tree, name, where) for name in POINT_KEYS}
    scalars = {k: tree.get(k) for k in names if k not in POINT_KEYS}
    return Calibration(**scalars, **points)  # type: ignore[arg-type]  # checked above


def intensity(m: float, n: float, k: float) -> float:
    """FLOPs per element a [m x k] @ [k x n] GEMM reads or writes: 2mnk / (mk + kn + mn). Small and skinny GEMMs
    have little of it, and it is what their achieved rate follows (the roofline, Williams et al. 2009)."""
    return 2.0 * m * n * k / (m * k + k * n + m * n)


def _fits(cal: Calibration, prefix: str = "") -> tuple[tuple[str, float, float], ...]:
    """(kind, latency per ring step, bus bandwidth) of the all-reduce, all-gather and reduce-scatter fits a
    calibration holds, inside a node (prefix "") or across nodes ("internode_")."""
    out = []
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        name = prefix + kind.replace("_", "")
        lat, bw = getattr(cal, f"{name}_latency_s"), getattr(cal, f"{name}_busbw")
        if bw and lat is not None:
            out.append((kind, lat, bw))
    return tuple(out)


def apply_calibration(cluster: Cluster, cal: Calibration) -> Cluster:
    """The cluster with measured compute, memory and intra-node collective figures and curves in place of the
    datasheet's, and the inter-node collective figures where `scaletrain bench --nodes` measured them."""
    if cal.device != cluster.gpu.name:
        raise CalibrationError(
            f"--calibration: measured on {cal.device!r}, but the plan is for "
            f"{cluster.gpu.name!r}; use --gpu {cal.device} or drop --calibration"
        )
    collectives, internode = _fits(cal), _fits(cal, "internode_")
    # bench records the cores only on a CPU host: there, GEMMs are costed by shape (cache, plan/efficiency.py) and a
    # collective amid compute pays the measured extra wait
    cpu = cal.host_cores is not None
    return dataclasses.replace(
        cluster,
        measured_matmul_shapes=tuple((m, n, k, f) for m, n, k, f in cal.matmul) if cpu and cal.matmul else None,
        host_cores=cal.host_cores,
        measured_sync_curve=tuple((g, x) for g, x in cal.collective_amid_compute) or None,
        measured_inter_sync_curve=tuple((g, x) for g, x in cal.internode_collective_amid_compute) or None,
        measured_matmul_flops=cal.matmul_flops,
        measured_busbw=cal.allreduce_busbw,
        measured_memory_bw=cal.memory_bw,
        measured_memory_bytes=cal.memory_bytes,
        measured_op_overhead_s=cal.op_overhead_s,
        measured_matmul_curve=tuple((intensity(m, n, k), f) for m, n, k, f in cal.matmul) or None,
        measured_copy_curve=tuple((2.0 * b, bw) for b, bw in cal.copy) or None,
        measured_collectives=collectives or None,
        measured_inter_collectives=internode or None,
        measured_attention=tuple((sq, d, f) for sq, d, f in cal.attention) or None,
        measured_step_matmul=tuple((m, n, k, f) for m, n, k, f in cal.step_matmul) if cpu and cal.step_matmul else None,
        measured_step_attention=tuple((sq, d, f) for sq, d, f in cal.step_attention)
        if cpu and cal.step_attention
        else None,
        measured_step_pointwise_bw=cal.step_pointwise_bw if cpu else None,
        calibration_note=f"calibrated on {cal.host} ({cal.ranks} ranks, {cal.matmul_dtype} matmul)",
    )
