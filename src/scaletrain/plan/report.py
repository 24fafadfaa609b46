"""The planner's whole answer for one workload and cluster, as data: the ranked layouts, why the first one, why not
the others, advice on the setup, and a token budget. `scaletrain plan` prints it as tables or dumps `to_dict()` as
JSON."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from scaletrain.hardware.cluster import Cluster
from scaletrain.plan.advice import Budget, budget_for, no_fit_message, setup_advice
from scaletrain.plan.explain import explain_alternatives, explain_top
from scaletrain.plan.layout import Workload
from scaletrain.plan.memory import MEMORY_LINES
from scaletrain.plan.pin import Pins, distance
from scaletrain.plan.search import PlanResult, PlanRow, SearchOptions, evaluate_layout, search_layouts


class DoesNotFit(ValueError):
    """No layout of the workload fits the cluster; the message says why and what setup would work (one line)."""


@dataclass
class PlanReport:
    result: PlanResult
    why: list[str]
    alternatives: list[str]
    advice: list[str]
    budget: Budget | None
    pinned: dict = field(default_factory=dict)  # config key -> value the search was held to
    evaluated: bool = False  # every layout field pinned: rows hold that one layout, fitting or not
    nearest: list[PlanRow] = field(default_factory=list)  # evaluated and too big or slow: fitting, faster layouts

    def to_dict(self) -> dict:
        """JSON-able: model, workload, cluster, search figures, layouts, explanations, advice, budget."""
        work, cluster, result = self.result.work, self.result.cluster, self.result
        return {
            "model": {"name": work.model_name, **dataclasses.asdict(work.args), "params": work.args.num_params()},
            "workload": {
                "seq_len": work.seq_len,
                "global_batch": work.global_batch,
                "doc_len": work.doc_len,
                "lora": _lora_dict(work),
            },
            "cluster": {
                "gpu": cluster.gpu.name,
                "gpus": cluster.gpus,
                "gpus_per_node": cluster.gpus_per_node,
                "nodes": cluster.nodes,
                "intra_link": cluster.intra_link.name,
                "inter_link": cluster.inter_link.name,
                "memory_bytes": cluster.memory_bytes,
                "calibration": cluster.calibration_note or None,
            },
            "searched": result.searched,
            "fitting": result.fitting,
            "search_seconds": result.seconds,
            "layouts": [r.to_dict() for r in result.rows],
            "why": self.why,
            "alternatives": self.alternatives,
            "advice": self.advice,
            "budget": self.budget.to_dict() if self.budget else None,
            "pinned": self.pinned,
            "evaluated": self.evaluated,
            "nearest": [r.to_dict() for r in self.nearest],
        }


def plan_report(work: Workload, cluster: Cluster, opts: SearchOptions, tokens: float | None = None) -> PlanReport:
    """Search every layout of `work` on `cluster` and explain the result; `tokens` adds a time/cost/energy budget.
    DoesNotFit when no layout fits."""
    result = search_layouts(work, cluster, opts)
    if not result.rows:
        raise DoesNotFit(no_fit_message(work, cluster, result, opts))
    return PlanReport(
        result,
        explain_top(result),
        explain_alternatives(result),
        setup_advice(work, cluster, result, opts),
        budget_for(result, tokens) if tokens else None,
        opts.pins.to_dict() if opts.pins else {},
    )


def overflow_lines(row: PlanRow, capacity: float) -> list[str]:
    """For a layout that does not fit: how far over it is, and its memory lines largest first (bytes as GB)."""
    if row.fits:
        return []
    lines = sorted(((k, row.memory[k]) for k in MEMORY_LINES if row.memory[k] > 0), key=lambda kv: -kv[1])
    return [
        f"does not fit: needs {row.memory_total / 1e9:.1f} GB of {capacity / 1e9:.1f} GB per GPU, "
        f"{(row.memory_total - capacity) / 1e9:.1f} GB over",
        *(f"{k}: {v / 1e9:.1f} GB ({v / row.memory_total:.0%})" for k, v in lines),
    ]


def evaluate_report(
    work: Workload, cluster: Cluster, layout, opts: SearchOptions, pins: Pins, nearest: int = 5
) -> PlanReport:
    """The prediction for one fully pinned layout, fitting or not, and the nearest layouts (fewest changed
    choices, then fastest) that fit and are faster than it."""
    row = evaluate_layout(work, cluster, layout)
    free = dataclasses.replace(opts, pins=None, top=100_000)
    result = search_layouts(work, cluster, free)
    faster = [r for r in result.rows if r.step_s < row.step_s]
    if not faster and not row.fits:  # nothing that fits is faster: the nearest that fit at all
        faster = list(result.rows)
    faster.sort(key=lambda r: (distance(r.layout, layout), r.step_s))
    result = dataclasses.replace(result, rows=[row])
    why = [f"{layout.describe()}: {row.step_s:.3g} s per step, {row.tokens_per_s:,.0f} tokens/s, MFU {row.mfu:.0%}."]
    why += overflow_lines(row, cluster.memory_bytes)
    alternatives = [
        f"{r.layout.describe()}: {r.step_s:.3g} s ({row.step_s / r.step_s:.2f}x the speed of this one), "
        f"{r.memory_total / 1e9:.1f} GB; {r.layout.as_overrides()}"
        for r in faster[:nearest]
    ]
    return PlanReport(result, why, alternatives, [], None, pins.to_dict(), True, faster[:nearest])


def compare_dict(work: Workload, tokens: float, budgets: list[Budget]) -> dict:
    """JSON-able comparison of one token budget across GPU types (from advice.compare_gpus)."""
    return {"model": work.model_name, "tokens": tokens, "compare": [b.to_dict() for b in budgets]}


def _lora_dict(work) -> dict | None:
    """--lora-rank / [lora] as planned: rank, adapted linears, adapter parameters of the model, the base's storage
    (quantize: 'nf4' for QLoRA's 4-bit base, else 'none')."""
    if work.lora is None:
        return None
    from scaletrain.plan.lora import adapter_params

    return {
        "rank": work.lora.rank,
        "targets": list(work.lora.targets),
        "adapter_params": adapter_params(work.args, work.lora),
        "quantize": "nf4" if work.lora.quantize else "none",
    }
