"""Pipeline schedules (torch.distributed.pipelining names): bubble, activations in flight, point-to-point volume.

p stages, m micro-batches, v stages per rank. Bubble ratios are bubble time / ideal (bubble-free) time; the share
of the total step is ratio / (1 + ratio), e.g. (p-1)/(m+p-1) for 1F1B.
Sources: GPipe/1F1B (p-1)/m and interleaved (p-1)/(v·m) [R]; zero-bubble family from the sail-sg
zero-bubble-pipeline-parallelism README [R] via formulas.md; DualPipeV from the deepseek-ai/DualPipe README
(unconfirmed: not in formulas.md). Interleaved activation factor 1 + (p-1)/(p·v) from Korthikanti et al. [T].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Schedule:
    name: str
    virtual_stages: int  # stages per rank
    p2p_factor: float  # point-to-point volume relative to 1F1B
    min_microbatch_factor: int  # needs m >= this x p
    source: str


SCHEDULES: tuple[Schedule, ...] = (
    Schedule("none", 1, 0.0, 0, "no pipeline"),
    Schedule("GPipe", 1, 1.0, 1, "bubble (p-1)/m, activations of all m micro-batches [R]"),
    Schedule("1F1B", 1, 1.0, 1, "bubble (p-1)/m, activations of min(p, m) micro-batches [R]"),
    Schedule("Interleaved1F1B", 2, 2.0, 1, "bubble (p-1)/(v·m) [R], activations x (1 + (p-1)/(p·v)) [T]"),
    Schedule("InterleavedZeroBubble", 2, 2.0, 1,
             "unconfirmed: ZB1P's bubble/3 [R] combined with interleaving's 1/v; activations as interleaved 1F1B"),
    Schedule("ZBVZeroBubble", 2, 2.0, 2, "ZB-V: bubble 0, 1x activations, 2x PP communication [R]; "
             "unconfirmed: assumed to need m >= 2p"),
    Schedule("DualPipeV", 2, 2.0, 2, "unconfirmed: DualPipe README, bubble (p/2-1)(F&B+B-3W) with F:B:W = 1:2:1 "
             "and no F&B overlap credit, activations of p+1 micro-batches"),
)
SCHEDULE_NAMES = tuple(s.name for s in SCHEDULES)


def schedule_index(name: str) -> int:
    """Index of a schedule in SCHEDULES by name (case-insensitive); ValueError lists the names."""
    for i, s in enumerate(SCHEDULES):
        if s.name.lower() == name.lower():
            return i
    raise ValueError(f"--schedules: unknown pipeline schedule {name!r}; choose from {', '.join(SCHEDULE_NAMES[1:])}")


def bubble_ratio(schedule, p, m, v):
    """Pipeline bubble time as a share of the bubble-free time (arrays or scalars)."""
    p, m, v = (np.asarray(x, dtype=np.float64) for x in (p, m, v))
    s = np.asarray(schedule)
    one_f1b = (p - 1) / m
    return np.select(
        [s == 0, s <= 2, s == 3, s == 4, s == 5, s == 6],
        [0.0 * p, one_f1b, (p - 1) / (v * m), (p - 1) / (3 * v * m), 0.0 * p,
         np.maximum(p - 2, 0) / (3 * m)])


def bubble_share(schedule, p, m, v):
    """Pipeline bubble as a share of the whole pipeline time, e.g. (p-1)/(m+p-1) for 1F1B."""
    r = bubble_ratio(schedule, p, m, v)
    return r / (1 + r)


def activations_in_flight(schedule, p, m, v):
    """Micro-batches whose activations the busiest rank holds at once, in units of one micro-batch through all of
    that rank's layers (1 without pipelining: accumulation frees each micro-batch before the next)."""
    p, m, v = (np.asarray(x, dtype=np.float64) for x in (p, m, v))
    s = np.asarray(schedule)
    interleaved = np.minimum(p, m) * (1 + (p - 1) / (p * v))
    return np.select([s == 0, s == 1, s == 2, s == 3, s == 4, s == 5, s == 6],
                     [1.0 + 0 * p, m, np.minimum(p, m), interleaved, interleaved, np.minimum(p, m),
                      np.minimum(p + 1, m)])


def p2p_factor(schedule):
    """Point-to-point activation traffic relative to 1F1B (interleaving and V shapes cross stages more often)."""
    return np.asarray([s.p2p_factor for s in SCHEDULES])[np.asarray(schedule)]
