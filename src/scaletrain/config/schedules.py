"""The pipeline schedules scaletrain runs (torch.distributed.pipelining names), each with the properties the config,
the trainer and the planner decide by. The one list: the config's choices, the trainer's checks and the planner's
search and formulas all derive from SCHEDULES. Pure Python, no torch (the config imports it).

Planner sources: GPipe/1F1B (p-1)/m and interleaved (p-1)/(v·m) [R]; zero-bubble family from the sail-sg
zero-bubble-pipeline-parallelism README [R] via formulas.md; DualPipeV from the deepseek-ai/DualPipe README
(unconfirmed: not in formulas.md). Interleaved activation factor 1 + (p-1)/(p·v) from Korthikanti et al. [T].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Bubble time / bubble-free time, p stages, m micro-batches, v stages per rank (plan/pipeline.py evaluates them):
# flush (p-1)/m; interleaved (p-1)/(v·m); interleaved_zero_bubble (p-1)/(3·v·m); zero 0; dualpipe_v max(p-2,0)/(3m)
BubbleFormula = Literal["flush", "interleaved", "interleaved_zero_bubble", "zero", "dualpipe_v"]
# Micro-batches whose activations the busiest rank holds: all m; per_stage min(p, m); interleaved
# min(p, m)·(1 + (p-1)/(p·v)); per_stage_plus_one min(p+1, m)
InFlightFormula = Literal["all", "per_stage", "interleaved", "per_stage_plus_one"]


@dataclass(frozen=True)
class PipelineSchedule:
    """One torch.distributed.pipelining schedule."""

    name: str  # torch's name, as get_schedule_class takes it
    placement: Literal["single", "looped", "v"]  # stages of a rank: one; rank, rank+pp, ...; rank and 2pp-1-rank
    split_backward: bool  # zero-bubble: backward runs as input- and weight-gradient passes (torch.compile cannot)
    microbatch_per_stage: bool  # torch refuses fewer micro-batches than stages
    microbatch_rounds: bool  # torch needs the micro-batches in whole rounds of pp
    # the planner's model (plan/pipeline.py)
    bubble: BubbleFormula
    in_flight: InFlightFormula
    p2p_factor: float  # point-to-point volume relative to 1F1B
    planner_min_m_per_pp: int  # the planner only proposes m >= this x pp
    planner_even_pp: bool  # the planner only proposes an even pp (pairs of ranks)
    source: str

    @property
    def stages_per_rank(self) -> int:
        """Stages per rank when parallel.pp_stages_per_rank is unset: 1, or 2 for looped and V schedules."""
        return 1 if self.placement == "single" else 2

    @property
    def v_shaped(self) -> bool:
        """A rank holds the first and the last chunk (stages rank and 2pp-1-rank)."""
        return self.placement == "v"


SCHEDULES: tuple[PipelineSchedule, ...] = (
    PipelineSchedule(
        "GPipe",
        "single",
        split_backward=False,
        microbatch_per_stage=False,
        microbatch_rounds=False,
        bubble="flush",
        in_flight="all",
        p2p_factor=1.0,
        planner_min_m_per_pp=1,
        planner_even_pp=False,
        source="bubble (p-1)/m, activations of all m micro-batches [R]",
    ),
    PipelineSchedule(
        "1F1B",
        "single",
        split_backward=False,
        microbatch_per_stage=True,
        microbatch_rounds=False,
        bubble="flush",
        in_flight="per_stage",
        p2p_factor=1.0,
        planner_min_m_per_pp=1,
        planner_even_pp=False,
        source="bubble (p-1)/m, activations of min(p, m) micro-batches [R]",
    ),
    PipelineSchedule(
        "Interleaved1F1B",
        "looped",
        split_backward=False,
        microbatch_per_stage=False,
        microbatch_rounds=True,
        bubble="interleaved",
        in_flight="interleaved",
        p2p_factor=2.0,
        planner_min_m_per_pp=1,
        planner_even_pp=False,
        source="bubble (p-1)/(v·m) [R], activations x (1 + (p-1)/(p·v)) [T]",
    ),
    PipelineSchedule(
        "InterleavedZeroBubble",
        "looped",
        split_backward=True,
        microbatch_per_stage=False,
        microbatch_rounds=True,
        bubble="interleaved_zero_bubble",
        in_flight="interleaved",
        p2p_factor=2.0,
        planner_min_m_per_pp=1,
        planner_even_pp=False,
        source="unconfirmed: ZB1P's bubble/3 [R] combined with interleaving's 1/v; activations as interleaved 1F1B",
    ),
    PipelineSchedule(
        "ZBVZeroBubble",
        "v",
        split_backward=True,
        microbatch_per_stage=False,
        microbatch_rounds=False,
        bubble="zero",
        in_flight="per_stage",
        p2p_factor=2.0,
        planner_min_m_per_pp=2,
        planner_even_pp=False,
        source="ZB-V: bubble 0, 1x activations, 2x PP communication [R]; unconfirmed: assumed to need m >= 2p",
    ),
    PipelineSchedule(
        "DualPipeV",
        "v",
        split_backward=True,
        microbatch_per_stage=True,
        microbatch_rounds=False,
        bubble="dualpipe_v",
        in_flight="per_stage_plus_one",
        p2p_factor=2.0,
        planner_min_m_per_pp=2,
        planner_even_pp=True,
        source="unconfirmed: DualPipe README, bubble (p/2-1)(F&B+B-3W) with F:B:W = 1:2:1 and no F&B overlap "
        "credit, activations of p+1 micro-batches",
    ),
)
SCHEDULE_NAMES: tuple[str, ...] = tuple(s.name for s in SCHEDULES)
DEFAULT_SCHEDULE = "1F1B"
_BY_NAME = {s.name.lower(): s for s in SCHEDULES}


def pipeline_schedule(name: str) -> PipelineSchedule:
    """The schedule called `name` (case-insensitive, as torch's get_schedule_class); ValueError lists the names."""
    try:
        return _BY_NAME[name.lower()]
    except KeyError:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose from {', '.join(SCHEDULE_NAMES)}") from None
