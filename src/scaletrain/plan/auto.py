"""`scaletrain train --plan auto`: the planner's fastest layout that the trainer can run, for the job's model,
sequence length and global batch on the ranks this command starts, applied to the job's config (Layout.apply).

The search is restricted to what the trainer runs (the user's precision, activation checkpointing or pipeline
schedule when they set one; context parallelism for sequences of 32k tokens and more), and every candidate is checked with the trainer's own
job resolution (resolve/job.py resolve_job) before it is chosen, so a plan that would be refused at launch is never picked.
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.config import JobConfig, load_config
from scaletrain.config.layout import AC_MODES, Layout, given_in_config
from scaletrain.config.schedules import SCHEDULE_NAMES
from scaletrain.hardware.calibration import apply_calibration, load_calibration
from scaletrain.hardware.cluster import Cluster, make_cluster
from scaletrain.plan.layout import Workload, runs_compiled
from scaletrain.plan.search import PlanRow, SearchOptions, search_layouts

PLAN_CHOICES = ("auto",)


@dataclass(frozen=True)
class AutoPlan:
    row: PlanRow
    config: JobConfig  # the job's config with the plan's layout applied (the user's own settings kept)
    cluster: Cluster
    runnable: int  # candidates checked before this one was accepted, plus one

    def summary(self) -> str:
        """One line: which plan, and why (its predicted step time)."""
        c = self.cluster
        cal = f", {c.calibration_note}" if c.calibration_note else ""
        return (
            f"plan auto: {self.row.layout.describe()} - predicted {self.row.step_s * 1e3:,.1f} ms/step, "
            f"{self.row.tokens_per_s:,.0f} tokens/s, the fastest layout the trainer runs on {c.gpus} x "
            f"{c.gpu.name}{cal}; applying {self.row.layout.as_overrides()}"
        )


def overruled(layout: Layout, cfg: JobConfig) -> list[str]:
    """Dotted keys the user set in `cfg` (TOML or override) to a value other than the layout's: a plan they would
    change."""
    return [
        f"{section}.{key}"
        for section, values in layout.settings().items()
        for key, value in values.items()
        if key in getattr(cfg, section).model_fields_set and getattr(getattr(cfg, section), key, None) != value
    ]


def local_cluster(gpu: str, nproc: int, nnodes: int, calibration: str | None = None) -> Cluster:
    """The cluster this command would run on: nnodes x nproc devices of catalog type `gpu`."""
    cluster = make_cluster(gpu, nproc * nnodes, gpus_per_node=nproc)
    if calibration:
        cluster = apply_calibration(cluster, load_calibration(calibration))
    return cluster


def auto_plan(
    path: str | None, overrides: list[str], nproc: int, nnodes: int, gpu: str, calibration: str | None = None
) -> AutoPlan:
    """The planner's fastest layout for this job that passes job resolution (resolve_job), as the trainer's would. ValueError: one line."""
    from scaletrain.models.registry import model_spec
    from scaletrain.resolve import resolve_job

    cfg = load_config(path, overrides)
    world = nproc * nnodes
    spec = model_spec(cfg.model)
    args = spec.shape() if spec.planner_formulas else None
    if args is None:
        raise ValueError(
            f"--plan auto: the planner cannot model the {spec.family} family (no decoder shape); "
            f"set the layout with parallel.* instead"
        )
    compiled = runs_compiled(cfg.parallel.compile is True, cfg.precision.fp8, gpu)  # as the trainer will run it
    work = Workload(cfg.model.name, args, cfg.data.seq_len, cfg.train.global_batch_size, cfg.precision.fp8, compiled)
    cluster = local_cluster(gpu, nproc, nnodes, calibration)
    p = cfg.parallel
    # on a CPU host bf16 is no faster (the catalog's CPU entry has equal rates) and fp32 is what dtype=auto runs there
    pinned = given_in_config(cfg, "precision") and cfg.precision.dtype != "auto"
    precisions = (cfg.precision.dtype,) if pinned else (("fp32",) if gpu == "cpu" else ("bf16", "fp32"))
    opts = SearchOptions(
        precisions=precisions,
        ac_modes=(p.activation_checkpoint,) if given_in_config(cfg, "ac") else AC_MODES,
        schedules=(p.pp_schedule,) if given_in_config(cfg, "schedule") else SCHEDULE_NAMES,
        cp=None,  # 1, plus 2/4/8 for sequences of 32k tokens and more (parallel/context_parallel.py)
        max_micro_batch=max(16, cfg.train.micro_batch_size or 1),
        top=10_000,
    )
    result = search_layouts(work, cluster, opts)
    for n, row in enumerate(result.rows, 1):
        # a plan the user's own settings would change is not the plan that runs
        if overruled(row.layout, cfg):
            continue
        try:
            planned = row.layout.apply(cfg)
            resolve_job(planned, world)
        except ValueError:  # ConfigError too: e.g. a setting the trainer lacks
            continue
        return AutoPlan(row, planned, cluster, n)
    raise ValueError(
        f"--plan auto: no layout of {work.model_name} (seq {work.seq_len}, global batch "
        f"{work.global_batch}) fits and runs on {world} x {cluster.gpu.name} with the settings given; "
        f"try `scaletrain plan` for why"
    )
