"""The planner's whole answer for one workload and cluster, as data: the ranked layouts, why the first one, why not
the others, advice on the setup, and a token budget. `scaletrain plan` prints it as tables or dumps `to_dict()` as
JSON."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from scaletrain.hardware.cluster import Cluster
from scaletrain.plan.advice import Budget, budget_for, no_fit_message, setup_advice
from scaletrain.plan.explain import explain_alternatives, explain_top
from scaletrain.plan.layout import Workload
from scaletrain.plan.search import PlanResult, SearchOptions, search_layouts


class DoesNotFit(ValueError):
    """No layout of the workload fits the cluster; the message says why and what setup would work (one line)."""


@dataclass
class PlanReport:
    result: PlanResult
    why: list[str]
    alternatives: list[str]
    advice: list[str]
    budget: Budget | None

    def to_dict(self) -> dict:
        """JSON-able: model, workload, cluster, search figures, layouts, explanations, advice, budget."""
        work, cluster, result = self.result.work, self.result.cluster, self.result
        return {
            "model": {"name": work.model_name, **dataclasses.asdict(work.args), "params": work.args.num_params()},
            "workload": {"seq_len": work.seq_len, "global_batch": work.global_batch},
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
    )


def compare_dict(work: Workload, tokens: float, budgets: list[Budget]) -> dict:
    """JSON-able comparison of one token budget across GPU types (from advice.compare_gpus)."""
    return {"model": work.model_name, "tokens": tokens, "compare": [b.to_dict() for b in budgets]}
