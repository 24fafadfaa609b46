"""Persistent stragglers: a rank whose busy time per step stays `ratio` times the median of the other ranks' for
at least `steps` consecutive steps is named (the log, the metrics records, the diagnosis and the report).

Fed the per-rank busy times every log step already gathers (timing.combine_ranks: data, forward, backward without
the time spent waiting for peers, optimizer), so it costs no collective of its own. Every rank sees the same
records and decides alike (rank 0's log is the one shown). A rank is judged over whole logging windows: with monitor.log_interval=10
and 20 steps, two windows in a row.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from scaletrain.monitor.progress import log


@dataclass
class StragglerWatch:
    ratio: float  # slower than the other ranks' median busy time by this factor
    steps: int  # for at least this many consecutive steps; 0: off
    _since: dict[int, int] = field(default_factory=dict)  # rank -> first step of its current slow streak
    _slow_steps: dict[int, int] = field(default_factory=dict)  # rank -> steps in that streak
    _named: set[int] = field(default_factory=set)

    def observe(self, record: dict, window_steps: int) -> None:
        """Judge the window ending at record["step"] (window_steps steps long) and add `stragglers` (ranks named
        now) and `straggler_ratios` (each rank's busy time over the others' median) to the record."""
        busy = record.get("busy_s_per_rank") or []
        if self.steps <= 0 or len(busy) < 2 or window_steps <= 0:
            return
        step = int(record["step"])
        ratios = []
        for rank, mine in enumerate(busy):
            others = statistics.median(b for i, b in enumerate(busy) if i != rank)
            ratios.append(mine / others if others > 0 else 1.0)
        record["straggler_ratios"] = [round(r, 3) for r in ratios]
        for rank, r in enumerate(ratios):
            if r >= self.ratio:
                self._since.setdefault(rank, step - window_steps + 1)
                self._slow_steps[rank] = self._slow_steps.get(rank, 0) + window_steps
            else:
                if rank in self._named:
                    log.info("straggler: rank %d is no longer slow at step %d (%.2fx the others)", rank, step, r)
                self._since.pop(rank, None)
                self._slow_steps.pop(rank, None)
                self._named.discard(rank)
        named = sorted(r for r, n in self._slow_steps.items() if n >= self.steps)
        for rank in named:
            if rank not in self._named:
                log.warning(
                    "straggler: rank %d has been %.2fx slower than the other ranks (busy %.1f ms per step against "
                    "a median of %.1f ms) for %d steps, since step %d (monitor.straggler_ratio=%g, "
                    "monitor.straggler_steps=%d); check that rank's device and host",
                    rank,
                    ratios[rank],
                    busy[rank] * 1e3,
                    busy[rank] / ratios[rank] * 1e3,
                    self._slow_steps[rank],
                    self._since[rank],
                    self.ratio,
                    self.steps,
                )
            self._named.add(rank)
        if named:
            record["stragglers"] = named
            record["straggler_since_step"] = [self._since[r] for r in named]
