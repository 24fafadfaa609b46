"""Search over layouts: dp_replicate x dp_shard x tp x pp (x cp), micro-batch size and accumulation, activation
checkpointing, precision and pipeline schedule; drop what does not fit, rank by predicted step time.

All candidates are evaluated at once as numpy columns (memory.py and steptime.py work on arrays), so a
trillion-parameter model on thousands of GPUs searches in well under a second.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from scaletrain.hardware.cluster import Cluster
from scaletrain.config.precisions import PRECISION_NAMES
from scaletrain.config.schedules import SCHEDULE_NAMES, pipeline_schedule
from scaletrain.config.layout import AC_MODES, Layout
from scaletrain.plan.layout import LayoutGrid, Workload
from scaletrain.plan.memory import DEFAULT_MEMORY_OPTIONS, MEMORY_LINES, MemoryOptions, memory_breakdown, total_bytes
from scaletrain.plan.lora import nf4_shards_whole
from scaletrain.plan.pin import Pins
from scaletrain.plan.pipeline import NO_PIPELINE, schedule_code, schedule_column
from scaletrain.plan.shapes import layout_columns, params_per_rank
from scaletrain.plan.steptime import TIME_LINES, peak_flops, step_seconds, time_breakdown


@dataclass(frozen=True)
class SearchOptions:
    precisions: tuple[str, ...] = ("bf16", "fp32")
    ac_modes: tuple[str, ...] = AC_MODES
    schedules: tuple[str, ...] = SCHEDULE_NAMES
    cp: tuple[int, ...] | None = None  # None: 1, plus 2/4/8 for sequences of 32k tokens and more
    max_micro_batch: int = 16
    max_tp: int | None = None
    max_pp: int | None = None  # 1: the model's family has no pipeline cut (cli/plan.py _family_limits)
    top: int = 10
    pins: Pins | None = None  # layout fields a job config fixes (plan/pin.py); None: search every value


@dataclass
class PlanRow:
    """One ranked layout with its predictions (bytes, seconds, shares in 0..1)."""

    layout: Layout
    memory: dict[str, float]
    time: dict[str, float]
    memory_total: float
    step_s: float
    tokens_per_s: float
    mfu: float
    bubble_share: float
    comm_share: float
    fits: bool

    def to_dict(self) -> dict:
        return {
            "layout": self.layout.to_dict(),
            "describe": self.layout.describe(),
            "memory_bytes": {**self.memory, "total": self.memory_total},
            "time_s": {**self.time, "step": self.step_s},
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "bubble_share": self.bubble_share,
            "comm_share": self.comm_share,
            "fits": self.fits,
        }


@dataclass
class PlanResult:
    work: Workload
    cluster: Cluster
    rows: list[PlanRow]
    searched: int
    fitting: int
    seconds: float
    # every candidate, for explanations
    grid: LayoutGrid = field(repr=False)
    mem_total: np.ndarray = field(repr=False)
    step: np.ndarray = field(repr=False)
    mem_lines: dict = field(repr=False)
    time_lines: dict = field(repr=False)

    @property
    def fits(self) -> bool:
        return bool(self.rows)

    def row_at(self, i: int) -> PlanRow:
        """The prediction for candidate i of the grid."""
        lay = self.grid.row(i)
        mem = {k: float(self.mem_lines[k][i]) for k in MEMORY_LINES}
        tim = {k: float(self.time_lines[k][i]) for k in TIME_LINES}
        step = float(self.step[i])
        tokens = self.work.tokens_per_step
        peak = float(peak_flops(self.cluster, self.grid.precision[i]))
        if self.cluster.measured_matmul_flops:
            peak = self.cluster.measured_matmul_flops
        mfu = self.work.model_flops_per_token * tokens / (step * self.cluster.gpus * peak)
        comm = tim["tp comm"] + tim["cp comm"] + tim["pp p2p"] + tim["dp comm exposed"]
        total = float(self.mem_total[i])
        return PlanRow(
            lay,
            mem,
            tim,
            total,
            step,
            tokens / step,
            mfu,
            tim["bubble"] / step,
            comm / step,
            total <= self.cluster.memory_bytes,
        )


# LoRA under tensor parallelism: whether the trainer runs it (resolve/job.py: adapters follow their base's split,
# without adapter dropout), so the search may place it
LORA_UNDER_TP = True


def divisors(n: int) -> list[int]:
    """Divisors of n, ascending, in O(sqrt n) (a million GPUs would take O(n) a second per call)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _tp_options(work: Workload, world: int, opts: SearchOptions) -> list[int]:
    a = work.args
    if work.lora is not None and (not LORA_UNDER_TP or work.lora.dropout or work.lora.quantize):
        return [1]  # the trainer refuses adapter dropout and a 4-bit base under TP (resolve/job.py check_lora_job)
    return [
        t
        for t in divisors(world)
        if a.n_heads % t == 0
        and (a.n_kv_heads % t == 0 or t % a.n_kv_heads == 0)
        and (opts.max_tp is None or t <= opts.max_tp)
    ]


def _cp_options(work: Workload, world: int, opts: SearchOptions) -> list[int]:
    if work.lora is not None:
        return [1]  # the trainer refuses LoRA under context parallelism (resolve/job.py check_lora_job)
    wanted = opts.cp if opts.cp is not None else ((1, 2, 4, 8) if work.seq_len >= 32768 else (1,))
    return [c for c in wanted if c == 1 or (world % c == 0 and work.seq_len % (2 * c) == 0)]


def enumerate_layouts(work: Workload, cluster: Cluster, opts: SearchOptions) -> LayoutGrid:
    """Every valid candidate whose model states alone fit, as a LayoutGrid."""
    world, args, gb = cluster.gpus, work.args, work.global_batch
    capacity = cluster.memory_bytes
    base = []
    for t in _tp_options(work, world, opts):
        for c in _cp_options(work, world // t, opts):
            for p in divisors(world // (t * c)):
                if p > args.n_layers or (opts.max_pp is not None and p > opts.max_pp):
                    continue
                dp = world // (t * c * p)
                if gb % dp:
                    continue
                for ds in divisors(dp):
                    if work.lora is not None and not nf4_shards_whole(args, work.lora, ds * c):
                        continue  # the trainer refuses a 4-bit base whose shards are not whole NF4 blocks
                    # fp32 weights + grads + AdamW states: 16 bytes per local parameter, a lower bound (LoRA's
                    # frozen base: its fp32 weights alone; a 4-bit base: half a byte a weight of its projections)
                    per_param = 16.0 if work.lora is None else (0.5 if work.lora.quantize else 4.0)
                    if per_param * params_per_rank(args, t, p, ds * c, work.seq_len)[0] > capacity:
                        continue
                    base.append((dp // ds, ds, t, p, c))
    if not base:
        return LayoutGrid(*(np.zeros(0, dtype=np.int64) for _ in range(11)))
    b = np.asarray(base, dtype=np.int64)

    mbs = [1 << i for i in range(0, 16) if (1 << i) <= opts.max_micro_batch]
    if opts.pins is not None and opts.pins.micro_batch is not None:
        mbs = [opts.pins.micro_batch]
    acs = [AC_MODES.index(a) for a in opts.ac_modes]
    precs = [PRECISION_NAMES.index(p) for p in opts.precisions]
    # compiled blocks cannot run a schedule that splits backward (config/schema.py refuses the pair)
    runnable = [s for s in opts.schedules if not (work.compile and pipeline_schedule(s).split_backward)]
    scheds = [NO_PIPELINE] + [schedule_code(s) for s in runnable]
    inner = np.array(np.meshgrid(mbs, acs, precs, scheds, indexing="ij")).reshape(4, -1).T
    rows_b = np.repeat(b, len(inner), axis=0)
    rows_i = np.tile(inner, (len(b), 1))
    dpr, dps, tp, pp, cp = rows_b.T
    mb, ac, prec, sched = rows_i.T
    dp = dpr * dps
    keep = (gb // dp) % mb == 0
    m = np.where(keep, gb // np.maximum(dp * mb, 1), 0)
    min_factor = schedule_column("planner_min_m_per_pp", 0)[sched]
    vstages = schedule_column("stages_per_rank", 1)[sched]
    piped = sched != NO_PIPELINE
    keep &= np.where(pp == 1, ~piped, piped & (m >= min_factor * pp) & (vstages * pp <= args.n_layers))
    keep &= ~(schedule_column("planner_even_pp", False)[sched] & (pp % 2 == 1))  # DualPipeV pairs stages
    vstages = np.where(pp == 1, 1, vstages)
    cols = [dpr, dps, tp, pp, cp, mb, m, ac, prec, sched, vstages]
    grid = LayoutGrid(*(c[keep] for c in cols))
    return grid.take(opts.pins.mask(grid)) if opts.pins else grid


def search_layouts(work: Workload, cluster: Cluster, opts: SearchOptions | None = None) -> PlanResult:
    """Evaluate every candidate layout of `work` on `cluster`; rows hold the fitting ones, fastest first."""
    opts = opts or SearchOptions()
    t0 = time.perf_counter()
    grid = enumerate_layouts(work, cluster, opts)
    if len(grid):
        cols = layout_columns(work, grid)
        mem = memory_breakdown(work, grid, cluster, cols)
        tim = time_breakdown(work, grid, cluster, cols)
        mem_total, step = total_bytes(mem), step_seconds(tim)
    else:
        mem, tim = {k: np.zeros(0) for k in MEMORY_LINES}, {k: np.zeros(0) for k in TIME_LINES}
        mem_total, step = np.zeros(0), np.zeros(0)
    result = PlanResult(work, cluster, [], len(grid), 0, 0.0, grid, mem_total, step, mem, tim)
    fits = np.flatnonzero(mem_total <= cluster.memory_bytes)
    result.fitting = len(fits)
    order = fits[np.argsort(step[fits], kind="stable")]
    result.rows = [result.row_at(int(i)) for i in order[: opts.top]]
    result.seconds = time.perf_counter() - t0
    return result


def evaluate_layout(
    work: Workload, cluster: Cluster, layout: Layout, options: MemoryOptions = DEFAULT_MEMORY_OPTIONS
) -> PlanRow:
    """Predictions for one given layout (fitting or not); `options`: the trainer's memory options."""
    grid = LayoutGrid.of([layout])
    cols = layout_columns(work, grid)
    mem = memory_breakdown(work, grid, cluster, cols, options)
    tim = time_breakdown(work, grid, cluster, cols, options)
    res = PlanResult(work, cluster, [], 1, 0, 0.0, grid, total_bytes(mem), step_seconds(tim), mem, tim)
    return res.row_at(0)
