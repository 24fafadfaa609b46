"""The planner: memory, compute and communication models of every layout, a search over them, and advice."""

from scaletrain.plan.advice import Budget, Fit, budget_for, compare_gpus, fits_on, smallest_setup
from scaletrain.plan.explain import explain_alternatives, explain_top
from scaletrain.config.layout import Layout
from scaletrain.plan.layout import Workload
from scaletrain.plan.search import PlanResult, PlanRow, SearchOptions, evaluate_layout, search_layouts

__all__ = [
    "Budget",
    "Fit",
    "Layout",
    "PlanResult",
    "PlanRow",
    "SearchOptions",
    "Workload",
    "budget_for",
    "compare_gpus",
    "evaluate_layout",
    "explain_alternatives",
    "explain_top",
    "fits_on",
    "search_layouts",
    "smallest_setup",
]
