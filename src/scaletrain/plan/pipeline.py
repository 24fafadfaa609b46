"""Pipeline schedules in the planner: bubble, activations in flight and point-to-point volume, vectorised over the
LayoutGrid's integer schedule codes. Each schedule's formulas and sources are its properties in
config/schedules.py; code 0 is "no pipeline", codes 1.. follow that registry's order.

p stages, m micro-batches, v stages per rank. Bubble ratios are bubble time / ideal (bubble-free) time; the share
of the total step is ratio / (1 + ratio), e.g. (p-1)/(m+p-1) for 1F1B.
"""

from __future__ import annotations

import numpy as np

from scaletrain.config.schedules import SCHEDULE_NAMES, SCHEDULES

NO_PIPELINE = 0  # the schedule code of layouts with pp == 1
CODE_NAMES: tuple[str, ...] = ("none", *SCHEDULE_NAMES)


def schedule_code(name: str) -> int:
    """The LayoutGrid code of a schedule name (case-insensitive; "none": no pipeline); ValueError lists the names."""
    for code, known in enumerate(CODE_NAMES):
        if known.lower() == name.lower():
            return code
    raise ValueError(f"--schedules: unknown pipeline schedule {name!r}; choose from {', '.join(SCHEDULE_NAMES)}")


def schedule_column(attr: str, no_pipeline) -> np.ndarray:
    """One property of every schedule by code: `no_pipeline` for code 0, then SCHEDULES' `attr` in order."""
    return np.asarray([no_pipeline, *(getattr(s, attr) for s in SCHEDULES)])


def v_shaped(schedule) -> np.ndarray:
    """True where a code's schedule puts the first and the last chunk on the same rank (V shape)."""
    return schedule_column("v_shaped", False)[np.asarray(schedule)]


# formula name (PipelineSchedule.bubble / .in_flight) -> f(p, m, v) on float arrays
_BUBBLE = {
    "flush": lambda p, m, v: (p - 1) / m,
    "interleaved": lambda p, m, v: (p - 1) / (v * m),
    "interleaved_zero_bubble": lambda p, m, v: (p - 1) / (3 * v * m),
    "zero": lambda p, m, v: 0.0 * p,
    "dualpipe_v": lambda p, m, v: np.maximum(p - 2, 0) / (3 * m),
}
_IN_FLIGHT = {
    "all": lambda p, m, v: m + 0 * p,
    "per_stage": lambda p, m, v: np.minimum(p, m),
    "interleaved": lambda p, m, v: np.minimum(p, m) * (1 + (p - 1) / (p * v)),
    "per_stage_plus_one": lambda p, m, v: np.minimum(p + 1, m),
}


def _by_formula(table: dict, attr: str, no_pipeline: float, schedule, p, m, v) -> np.ndarray:
    p, m, v = (np.asarray(x, dtype=np.float64) for x in (p, m, v))
    s = np.asarray(schedule)
    names = schedule_column(attr, "")[s]
    out = np.full(np.broadcast(s, p, m, v).shape, no_pipeline, dtype=np.float64)
    for name, formula in table.items():
        sel = names == name
        if np.any(sel):
            out = np.where(sel, formula(p, m, v), out)
    return out


def bubble_ratio(schedule, p, m, v):
    """Pipeline bubble time as a share of the bubble-free time (arrays or scalars), by each schedule's formula."""
    return _by_formula(_BUBBLE, "bubble", 0.0, schedule, p, m, v)


def bubble_share(schedule, p, m, v):
    """Pipeline bubble as a share of the whole pipeline time, e.g. (p-1)/(m+p-1) for 1F1B."""
    r = bubble_ratio(schedule, p, m, v)
    return r / (1 + r)


def activations_in_flight(schedule, p, m, v):
    """Micro-batches whose activations the busiest rank holds at once, in units of one micro-batch through all of
    that rank's layers (1 without pipelining: accumulation frees each micro-batch before the next)."""
    return _by_formula(_IN_FLIGHT, "in_flight", 1.0, schedule, p, m, v)


def p2p_factor(schedule):
    """Point-to-point activation traffic relative to 1F1B (interleaving and V shapes cross stages more often)."""
    return schedule_column("p2p_factor", 0.0).astype(np.float64)[np.asarray(schedule)]


# a schedule added to the registry with a formula name this module does not evaluate would silently get 0
_unknown = [s.name for s in SCHEDULES if s.bubble not in _BUBBLE or s.in_flight not in _IN_FLIGHT]
if _unknown:
    raise ImportError(f"plan/pipeline.py: no bubble or activation formula for {', '.join(_unknown)}")
