"""Planning a model the decoder formulas do not describe, from its trace (plan/trace.py): memory per rank and
seconds per step of the data-parallel layouts the trainer runs for any model (DDP and FSDP2 over every rank, micro-
batch and accumulation, no or full activation checkpointing, each compute dtype), ranked, with what dominates.

Memory lines are those of plan/memory.py (MEMORY_LINES): fp32 parameters, gradients and AdamW states (FSDP2 shards
dim 0 of every tensor: torch.chunk, rank 0 largest), FSDP2's gathered blocks (one computing, one prefetched, the
root kept, a block's gradient while it is reduced) or autocast's low-precision weight copies and DDP's buckets,
the activations the trace saw autograd keep (full checkpointing: the blocks' inputs, plus one block's activations
while it is recomputed), the fixed CUDA context and NCCL buffers, fragmentation.
Time lines are those of plan/steptime.py (TIME_LINES): the traced matmul and attention FLOPs at the cluster's
matmul rate and attention fraction, the other ops' traced bytes at memory bandwidth, full checkpointing's second
forward of the blocks, the host's dispatch of every traced op, DP collectives beyond what overlaps compute, the
optimizer's bytes. Tensor, pipeline and context parallelism need a family's plans: not searched here.
A trace is linear in the micro-batch: one traced micro-batch is scaled to every size searched.
"""

from __future__ import annotations

import math
import time
import dataclasses
from dataclasses import dataclass, field

import numpy as np

from scaletrain.config.layout import Layout
from scaletrain.hardware.cluster import Cluster
from scaletrain.plan.comm import collective_seconds
from scaletrain.plan.efficiency import (
    amid_compute_seconds,
    gemm_features,
    in_step_factors,
    memory_seconds,
    nearest_rates,
    pointwise_seconds,
)
from scaletrain.plan.memory import (
    CUDA_CONTEXT_BYTES,
    DDP_BUCKET_CAP_BYTES,
    FRAGMENTATION_SHARE,
    MEMORY_LINES,
    NCCL_BYTES_PER_GROUP,
    OPTIMIZER_TEMP_BYTES,
)
from scaletrain.plan.steptime import ADAMW_BYTES_PER_PARAM, ADAMW_INPLACE_WRITE_BYTES, TIME_LINES, matmul_rate
from scaletrain.plan.trace import ROOT, ModelTrace

TRACED_AC_MODES = ("none", "full")


@dataclass
class TracedRow:
    """One layout's predictions: bytes per rank and seconds per step, each by line."""

    layout: Layout
    memory: dict[str, float]
    time: dict[str, float]
    fits: bool

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())

    @property
    def step_s(self) -> float:
        return sum(self.time.values())

    def dominant(self) -> tuple[str, float, str, float]:
        """(memory line, its share of the total, time line, its share of the step) that weigh most."""
        mem = max(self.memory, key=lambda k: self.memory[k])
        tim = max(self.time, key=lambda k: self.time[k])
        return mem, self.memory[mem] / self.memory_total, tim, self.time[tim] / max(self.step_s, 1e-30)

    def to_dict(self) -> dict:
        mem, mem_share, tim, tim_share = self.dominant()
        return {
            "layout": self.layout.to_dict(),
            "describe": self.layout.describe(),
            "memory_bytes": {**self.memory, "total": self.memory_total},
            "time_s": {**self.time, "step": self.step_s},
            "fits": self.fits,
            "dominant_memory": {"line": mem, "share": mem_share},
            "dominant_time": {"line": tim, "share": tim_share},
        }


@dataclass
class TracedPlan:
    traces: dict[str, ModelTrace]  # by compute dtype
    cluster: Cluster
    global_batch: int  # samples per optimizer step
    rows: list[TracedRow]  # ranked: fitting layouts by step time, then the rest by memory
    searched: int
    seconds: float
    advice: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        trace = next(iter(self.traces.values()))
        return {
            "model": trace.name,
            "params": trace.params,
            "blocks": trace.n_blocks,
            "global_batch": self.global_batch,
            "gpus": self.cluster.gpus,
            "gpu": self.cluster.gpu.name,
            "searched": self.searched,
            "trace_seconds": sum(t.seconds for t in self.traces.values()),
            "top_ops": [{"where": w, "op": op, "flops": f, "bytes": b} for w, op, f, b in trace.top_ops()],
            "rows": [r.to_dict() for r in self.rows],
            "advice": self.advice,
        }


@dataclass(frozen=True)
class TableShape:
    """A model's embedding tables sharded over the data-parallel ranks (parallel/embedding.py): each table's rows, their
    width, and parallel.embedding_sharding. Their weights stay out of DDP's all-reduce and FSDP2's gathers; each
    micro-batch sends every rank its samples' rows by one all-to-all forward and one backward."""

    rows: tuple[int, ...]
    dim: int
    sharding: str = "row"

    @property
    def elements(self) -> int:
        return sum(self.rows) * self.dim

    def shapes(self) -> list[tuple[int, ...]]:
        return [(n, self.dim) for n in self.rows]

    def elements_per_rank(self, dp: int) -> int:
        from scaletrain.config.table_sharding import table_elements_per_rank

        return table_elements_per_rank(list(self.rows), self.dim, self.sharding if dp > 1 else "none", dp)

    def a2a_bytes(self, samples: int, dp: int) -> float:
        """Bytes the busiest rank sends in one all-to-all of a micro-batch of `samples` per rank (fp32 rows, itself
        included): row-wise a partial row of every table for every rank's samples, table-wise its own tables'."""
        tables = len(self.rows)
        if self.sharding == "table":
            from scaletrain.config.table_sharding import assign_tables

            owner = assign_tables(list(self.rows), dp)
            tables = max(owner.count(r) for r in range(dp))
        return 4.0 * dp * samples * tables * self.dim


def table_shape(spec, sharding: str = "row") -> TableShape | None:
    """The model's embedding tables as the planner shards them (`sharding`: parallel.embedding_sharding); None for
    a model without any."""
    path = spec.embedding_tables()
    if path is None:
        return None
    tables = spec.build("meta").get_submodule(path)
    return TableShape(tuple(int(n) for n in tables.rows), int(tables.dim), sharding)


def job_row(cfg, world: int, cluster: Cluster) -> TracedRow:
    """The traced prediction of exactly the layout `scaletrain train` runs for `cfg` on `world` ranks (the trace
    of the model it builds, data bound, at its compute dtype). ValueError where the job is refused, or its layout
    has tensor, pipeline or context parallelism (not planned from a trace)."""
    from scaletrain.plan.trace import spec_target, trace_model
    from scaletrain.resolve import resolve_job

    resolved = resolve_job(cfg, world)
    layout = resolved.layout
    if layout.tp * layout.pp * layout.cp > 1:
        raise ValueError(f"{layout.describe()}: a plan from a trace covers data-parallel layouts only")
    trace = trace_model(spec_target(resolved.spec, cfg.data.seq_len), layout.precision)
    tables = table_shape(resolved.spec, cfg.parallel.embedding_sharding)
    mem = traced_memory(trace, layout, cluster, tables)
    return TracedRow(
        layout, mem, traced_time(trace, layout, cluster, tables), sum(mem.values()) <= cluster.memory_bytes
    )


def _without(shapes: list, removed: list) -> list:
    """`shapes` with each of `removed` taken out once (the tables among the root's parameters)."""
    left = list(shapes)
    for shape in removed:
        left.remove(tuple(shape))
    return left


def _sharded_numel(shapes, shards: int) -> int:
    """Elements rank 0 keeps when FSDP2 chunks dim 0 of each tensor over `shards` ranks (torch.chunk)."""
    return sum(min(s[0], -(-s[0] // shards)) * math.prod(s[1:]) if s else 1 for s in shapes)


def _all_shapes(trace: ModelTrace):
    return [s for lay in trace.layers for _ in range(lay.repeat) for s in lay.param_shapes]


def _sharded_tables(tables: TableShape | None, layout: Layout) -> bool:
    return tables is not None and tables.sharding != "none" and layout.dp > 1


def traced_memory(
    trace: ModelTrace, layout: Layout, cluster: Cluster, tables: TableShape | None = None
) -> dict[str, float]:
    """Bytes per rank, one value per MEMORY_LINES entry, for a DDP / FSDP layout (tp = pp = cp = 1); `tables`: the
    model's embedding tables sharded over the data-parallel ranks beside it."""
    on_gpu = cluster.gpu.name != "cpu"
    e = float(trace.element_bytes)
    scale = layout.micro_batch / trace.samples
    fsdp = layout.mode.sharded
    apart = _sharded_tables(tables, layout)
    shapes = _without(_all_shapes(trace), tables.shapes()) if apart and tables is not None else _all_shapes(trace)
    held = tables.elements_per_rank(layout.dp) if apart and tables is not None else 0
    n = trace.params - (tables.elements if apart and tables is not None else 0)  # what data parallelism handles
    local = (_sharded_numel(shapes, layout.dp_shard) if fsdp else n) + held
    tensors = trace.param_tensors
    lines = dict.fromkeys(MEMORY_LINES, 0.0)
    lines["parameters"] = 4.0 * local
    lines["gradients"] = 4.0 * local
    lines["optimizer states"] = 8.0 * local + 4.0 * tensors
    if fsdp:
        root = trace.layer(ROOT).params - (trace.params - n)  # the sharded tables are not gathered
        block = trace.largest_block_params
        # two blocks gathered (one computing, one prefetched) and the root; a block's whole gradient in the compute
        # dtype and its fp32 reduce copy while it is reduce-scattered (plan/memory.py, the same rule)
        # A block's gradient comes after backward has freed that block's activations: it adds only what exceeds them
        # (measured on CPU ranks, train/peak_memory.py: the peak is at the start of backward, before any gradient)
        reduce = max(0.0, (e + 4) * block - trace.largest_block_saved * scale)
        lines["gathered/cast weights"] = e * (2 * block + root) + reduce if block else e * n + 4 * n
    elif e < 4:
        # autocast's cached low-precision copies of the weights it multiplies with (matrices and kernels)
        lines["gathered/cast weights"] = e * sum(math.prod(s) for s in shapes if len(s) >= 2)
    lines["activations"] = trace.saved_bytes(layout.ac) * scale
    if layout.ac == "full":
        lines["recompute working set"] = trace.largest_block_saved * scale
    groups = 1.0 if layout.dp > 1 else 0.0
    ddp = layout.dp_replicate > 1 and not fsdp
    lines["comm buffers"] = (4.0 * n if ddp else 0.0) + (NCCL_BYTES_PER_GROUP * groups if on_gpu else 0.0)
    lines["CUDA context"] = CUDA_CONTEXT_BYTES if on_gpu else 0.0
    dynamic = lines["activations"] + lines["recompute working set"] + lines["gathered/cast weights"]
    if layout.accumulation == 1:
        # one micro-batch: zero_grad(set_to_none) freed the gradients, so they and the activations are never held
        # at once (backward frees a block's activations as it makes its gradients, which DDP reduces in its own
        # buckets and FSDP2 reduce-scatters to shards); the optimizer step holds every gradient and foreach AdamW's
        # sqrt(v) list (memory.py, the same rule for one rank). The gradients line is what they add to the larger
        # of the two peaks. Measured on CPU ranks for DDP and FSDP2 (tests/test_plan_peak_memory.py).
        step_peak = lines["gradients"] + OPTIMIZER_TEMP_BYTES * local
        lines["gradients"] = max(0.0, step_peak - dynamic)
    # a GPU's caching allocator keeps slack; the CPU allocator returns freed blocks (what is live is what is held)
    lines["fragmentation"] = FRAGMENTATION_SHARE * dynamic if on_gpu else 0.0
    return lines


def _attention_rate(cluster: Cluster, precision: str) -> float:
    mm = float(matmul_rate(cluster, _precision_code(precision)))
    return mm * cluster.gpu.attention_efficiency / cluster.gpu.matmul_efficiency


def _precision_code(precision: str) -> int:
    from scaletrain.config.precisions import PRECISION_NAMES

    return PRECISION_NAMES.index(precision)


def _matmul_seconds(trace: ModelTrace, cluster: Cluster, precision: str, phase: str, blocks_only: bool) -> float:
    """The traced matmuls' seconds: at the matmul rate; on a CPU calibration (bench's GEMM shapes) each operator
    at the measured rate of its per-call working set and intensity (its bytes and FLOPs per call: the trace
    records no shapes, and a layer's calls of one operator are averaged), times what a real step's GEMMs took over
    the curve (in_step_factors), as plan/efficiency.py gemm_seconds prices a decoder's GEMMs by shape."""
    ops = [
        o
        for o in trace.ops
        if o.kind == "matmul" and o.phase == phase and not (blocks_only and o.layer == ROOT) and o.flops > 0
    ]
    shapes = cluster.measured_matmul_shapes
    if not shapes:
        return sum(o.flops * trace.layer(o.layer).repeat for o in ops) / float(
            matmul_rate(cluster, _precision_code(precision))
        )
    pts = np.asarray(shapes, dtype=np.float64)
    points = np.stack(gemm_features(*pts[:, :3].T), axis=-1)
    e = float(trace.element_bytes)
    seconds = 0.0
    for o in ops:
        ws = max(o.bytes / o.calls / e, 1.0)
        rate = float(nearest_rates((np.log(ws), np.log(o.flops / o.calls / ws)), points, pts[:, 3]))
        seconds += o.flops * trace.layer(o.layer).repeat / rate
    return seconds * in_step_factors(cluster)[0]


def _compute_seconds(trace: ModelTrace, cluster: Cluster, precision: str, phase: str, blocks_only: bool = False):
    flops_attn = trace.flops(phase, "attention", blocks_only)
    moved = trace.bytes_moved(phase, "memory", blocks_only)
    calls = max(trace.op_calls(phase, blocks_only), 1)
    return (
        _matmul_seconds(trace, cluster, precision, phase, blocks_only)
        + flops_attn / _attention_rate(cluster, precision)
        + float(pointwise_seconds(moved, moved / calls, cluster))
    )


TABLE_GRAD_OP = "aten.embedding_dense_backward"  # a table's dense gradient: the whole table each micro-batch
LOOKUP_OP = "aten.embedding"  # counted by the trace with the whole table read; a lookup reads only its rows


def _op_bytes(trace: ModelTrace, op: str) -> float:
    return sum(o.bytes for o in trace.ops if o.op == op)


def _table_seconds(trace: ModelTrace, tables: TableShape, layout: Layout, cluster: Cluster) -> tuple[float, float]:
    """(forward, backward) seconds of the tables' ops in one micro-batch of this layout, replacing the traced ones
    (which scale with the micro-batch): a lookup moves its rows and ids (the trace's bytes without the tables'
    fp32 weights), for every rank's samples when the tables are sharded; the dense gradient writes the table (this
    rank's share) once per micro-batch."""
    scale = layout.micro_batch / trace.samples
    apart = _sharded_tables(tables, layout)
    lookup = max(0.0, _op_bytes(trace, LOOKUP_OP) - 4.0 * tables.elements) * scale * (layout.dp if apart else 1)
    share = tables.elements_per_rank(layout.dp) / tables.elements if apart else 1.0
    grad = _op_bytes(trace, TABLE_GRAD_OP) * share
    return float(pointwise_seconds(lookup, lookup, cluster)), float(pointwise_seconds(grad, grad, cluster))


def traced_time(
    trace: ModelTrace, layout: Layout, cluster: Cluster, tables: TableShape | None = None
) -> dict[str, float]:
    """Seconds per optimizer step, one value per TIME_LINES entry, for a DDP / FSDP layout; `tables` as for
    traced_memory: their all-to-alls (forward and backward of every micro-batch, on the critical path) count in
    "dp comm exposed"."""
    on_gpu = cluster.gpu.name != "cpu"
    scale = layout.micro_batch / trace.samples
    m = layout.accumulation
    fwd = _compute_seconds(trace, cluster, layout.precision, "forward") * scale
    bwd = _compute_seconds(trace, cluster, layout.precision, "backward") * scale
    lines = dict.fromkeys(TIME_LINES, 0.0)
    if tables is not None:  # the tables' ops priced by what they move (_table_seconds), not as traced
        for op, phase in ((LOOKUP_OP, "forward"), (TABLE_GRAD_OP, "backward")):
            traced = _op_bytes(trace, op)
            seconds = float(pointwise_seconds(traced, traced, cluster)) * scale
            fwd, bwd = (fwd - seconds, bwd) if phase == "forward" else (fwd, bwd - seconds)
        lookup, grad = _table_seconds(trace, tables, layout, cluster)
        fwd, bwd = fwd + lookup, bwd + grad
    lines["compute"] = (fwd + bwd) * m
    if layout.ac == "full":
        lines["recompute"] = _compute_seconds(trace, cluster, layout.precision, "forward", True) * scale * m
    calls = trace.op_calls() + (trace.op_calls("forward", True) if layout.ac == "full" else 0)
    host = calls * cluster.op_overhead_s * m
    kernels = lines["compute"] + lines["recompute"]
    lines["op dispatch"] = host if not on_gpu else max(0.0, host - kernels)

    e = float(trace.element_bytes)
    apart = _sharded_tables(tables, layout)
    n = trace.params - (tables.elements if apart and tables is not None else 0)
    dp = layout.dp
    if dp > 1:
        units = max(trace.n_blocks, 1) + 1
        if layout.mode.sharded:
            gathers = 2 * m * float(collective_seconds("all_gather", e * n, dp, 1, cluster))
            reduces = m * float(collective_seconds("reduce_scatter", 4.0 * n, dp, 1, cluster))
            latency = units * m * 3 * cluster.intra_link.latency_s
            comm = gathers + reduces + latency
        else:
            buckets = math.ceil(4.0 * n / DDP_BUCKET_CAP_BYTES)
            comm = float(collective_seconds("all_reduce", 4.0 * n, dp, 1, cluster)) + (buckets - 1) * float(
                collective_seconds("all_reduce", 0.0, dp, 1, cluster)
            )
        overlap = cluster.gpu.comm_overlap * (fwd + bwd) * m
        lines["dp comm exposed"] = max(comm - overlap, comm * (1.0 - cluster.gpu.comm_overlap))
        lines["dp comm exposed"] += _collective_waits(layout, units, fwd, bwd, 4.0 * n, cluster)
    shapes = _all_shapes(trace)
    local = n
    if apart and tables is not None:
        from scaletrain.plan.experts import all_to_all_seconds

        a2a = all_to_all_seconds(tables.a2a_bytes(layout.micro_batch, dp), dp, cluster)
        lines["dp comm exposed"] += 2 * m * a2a  # the forward waits for its rows, the backward for their gradients
        shapes = _without(shapes, tables.shapes())
        local = n + tables.elements_per_rank(dp)
    if layout.mode.sharded:
        local = _sharded_numel(shapes, layout.dp_shard) + (local - n)
    per_param = ADAMW_BYTES_PER_PARAM + (ADAMW_INPLACE_WRITE_BYTES if on_gpu else 0.0)
    lines["optimizer"] = float(memory_seconds(per_param * local, cluster))
    return lines


def _collective_waits(layout: Layout, units: int, fwd: float, bwd: float, grad_bytes: float, cluster: Cluster) -> float:
    """What the step's DP collectives wait for the last rank to arrive (a CPU calibration's curve of a collective
    amid compute, plan/efficiency.py amid_compute_seconds; 0 elsewhere), as plan/steptime.py counts it for a
    decoder: FSDP2 gathers each unit after one unit's forward, and in backward a gather and a reduce-scatter share
    one unit's backward, every micro-batch; DDP all-reduces each bucket after its share of the last micro-batch's
    backward. `fwd`, `bwd`: one micro-batch's compute seconds."""
    dp, m, blocks = layout.dp, layout.accumulation, max(units - 1, 1)
    if layout.mode.sharded:
        sync_fwd = float(amid_compute_seconds(fwd / blocks, dp, cluster))
        sync_bwd = float(amid_compute_seconds(bwd / blocks / 2.0, dp, cluster))
        return m * (units * sync_fwd + (units - 1) * sync_bwd + units * sync_bwd)
    buckets = math.ceil(grad_bytes / DDP_BUCKET_CAP_BYTES)
    return buckets * float(amid_compute_seconds(bwd / buckets, dp, cluster))


def candidate_layouts(world: int, global_batch: int, precisions, ac_modes, max_micro_batch: int = 64) -> list[Layout]:
    """DDP and FSDP over all `world` ranks (one rank: neither), micro-batches of powers of two that divide each
    rank's share of the global batch, for every precision and checkpointing mode."""
    if global_batch % world:
        raise ValueError(f"--global-batch: {global_batch} samples do not split over {world} ranks; use a multiple")
    share = global_batch // world
    modes = [(world, 1)] if world == 1 else [(world, 1), (1, world)]
    out = []
    for rep, shard in modes:
        mb = 1
        while mb <= min(share, max_micro_batch):
            if share % mb == 0:
                for prec in precisions:
                    for ac in ac_modes:
                        out.append(Layout(rep, shard, 1, 1, 1, mb, share // mb, ac, prec))
            mb *= 2
    return out


def plan_traced(
    traces: dict[str, ModelTrace],
    cluster: Cluster,
    global_batch: int,
    ac_modes=TRACED_AC_MODES,
    top: int = 10,
    tables: TableShape | None = None,
) -> TracedPlan:
    """Every candidate layout priced from the traces (one per compute dtype), fitting ones first by step time;
    `tables`: the model's embedding tables, sharded over the data-parallel ranks (TableShape)."""
    started = time.perf_counter()
    for ac in ac_modes:
        if ac not in TRACED_AC_MODES:
            raise ValueError(f"--ac: {ac!r} is not planned from a trace; use none or full")
    if all(t.n_blocks == 0 for t in traces.values()):  # no blocks to checkpoint: full would keep the same
        ac_modes = ("none",)
    layouts = candidate_layouts(cluster.gpus, global_batch, tuple(traces), ac_modes)
    rows = []
    for lay in layouts:
        trace = traces[lay.precision]
        mem = traced_memory(trace, lay, cluster, tables)
        fits = sum(mem.values()) <= cluster.memory_bytes
        rows.append(TracedRow(lay, mem, traced_time(trace, lay, cluster, tables), fits))
    rows.sort(key=lambda r: (not r.fits, r.step_s if r.fits else r.memory_total))
    plan = TracedPlan(traces, cluster, global_batch, rows[:top], len(layouts), time.perf_counter() - started)
    plan.advice = one_change_advice(rows, cluster)
    return plan


def _changed(a: Layout, b: Layout) -> list[str]:
    return [f.name for f in dataclasses.fields(Layout) if getattr(a, f.name) != getattr(b, f.name)]


def one_change_advice(rows: list[TracedRow], cluster: Cluster) -> list[str]:
    """Which change of one choice helps the first row most: where it fits, the change that would make its step
    shortest, and the memory that change needs (it is first because that does not fit); where nothing fits, the
    change that takes the most memory off."""
    if not rows:
        return []
    top = rows[0]
    # one choice: the data-parallel mode, checkpointing, precision, or the micro-batch (with its accumulation)
    near = [r for r in rows[1:] if len(set(_changed(top.layout, r.layout)) - {"accumulation"}) == 1]
    if not near:
        return []
    cap = cluster.memory_bytes

    def what(r: TracedRow) -> str:
        fields_ = [f for f in _changed(top.layout, r.layout) if f != "accumulation"]
        return ", ".join(f"{f} {getattr(top.layout, f)} -> {getattr(r.layout, f)}" for f in fields_)

    if top.fits:
        faster = min(near, key=lambda r: r.step_s)
        if faster.step_s >= top.step_s:
            return [
                f"no single change is faster; the next best is {what(faster)} ({faster.step_s / top.step_s - 1:+.0%})"
            ]
        return [
            f"{what(faster)} would be {1 - faster.step_s / top.step_s:.0%} faster but needs "
            f"{faster.memory_total / 1e9:.1f} GB per rank ({cap / 1e9:.0f} GB here)"
        ]
    leaner = min(near, key=lambda r: r.memory_total)
    return [
        f"{what(leaner)} takes {1 - leaner.memory_total / top.memory_total:.0%} of memory off "
        f"({leaner.memory_total / 1e9:.1f} GB per rank, {cap / 1e9:.0f} GB here)"
    ]
