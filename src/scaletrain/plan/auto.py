"""`scaletrain train --plan auto`: the planner's fastest layout that the trainer can run, for the job's model,
sequence length and global batch on the ranks this command starts, as config overrides.

The search is restricted to what the trainer runs (no context parallelism; the user's precision, activation
checkpointing or pipeline schedule when they set one), and every candidate is checked with the trainer's own
preflight (resolve_job) before it is chosen, so a plan that would be refused at launch is never picked.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from scaletrain.config import JobConfig, load_config
from scaletrain.config.load import parse_override
from scaletrain.config.schema import PP_SCHEDULES
from scaletrain.hardware.calibration import apply_calibration, load_calibration
from scaletrain.hardware.cluster import Cluster, make_cluster
from scaletrain.plan.layout import AC_MODES, Layout, Workload
from scaletrain.plan.search import PlanRow, SearchOptions, search_layouts

PLAN_CHOICES = ("auto",)


@dataclass(frozen=True)
class AutoPlan:
    row: PlanRow
    overrides: list[str]  # the plan's config overrides (the user's own come after them and win)
    cluster: Cluster
    runnable: int  # candidates checked before this one was accepted, plus one

    def summary(self) -> str:
        """One line: which plan, and why (its predicted step time)."""
        c = self.cluster
        cal = f", {c.calibration_note}" if c.calibration_note else ""
        return (f"plan auto: {self.row.layout.describe()} - predicted {self.row.step_s * 1e3:,.1f} ms/step, "
                f"{self.row.tokens_per_s:,.0f} tokens/s, the fastest layout the trainer runs on {c.gpus} x "
                f"{c.gpu.name}{cal}; applying {' '.join(self.overrides)}")


def explicit_keys(path: str | None, overrides: list[str] | tuple[str, ...]) -> set[str]:
    """Dotted keys (`precision.dtype`) the user set in the config file or on the command line."""
    keys: set[str] = set()

    def walk(tree: dict, prefix: str) -> None:
        for k, v in tree.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                keys.add(f"{prefix}{k}")

    if path is not None and Path(path).is_file():
        try:
            walk(tomllib.loads(Path(path).read_text()), "")
        except (tomllib.TOMLDecodeError, UnicodeDecodeError):
            pass  # load_config reports it
    for text in overrides:
        keys.add(".".join(parse_override(text)[0]))
    return keys


def layout_overrides(layout: Layout) -> list[str]:
    """The trainer's overrides for a layout: Layout.to_overrides, every key checked against JobConfig, plus
    sequence parallelism for tp > 1 (the planner's TP model assumes it). ValueError: the trainer lacks a key."""
    out = layout.to_overrides().split()
    if layout.tp > 1:
        out.append("parallel.sequence_parallel=true")
    for text in out:
        section, key = parse_override(text)[0]
        model = JobConfig.model_fields.get(section)
        if model is None or key not in model.annotation.model_fields:
            raise ValueError(f"{section}.{key}: the trainer has no such setting")
    return out


def local_cluster(gpu: str, nproc: int, nnodes: int, calibration: str | None = None) -> Cluster:
    """The cluster this command would run on: nnodes x nproc devices of catalog type `gpu`."""
    cluster = make_cluster(gpu, nproc * nnodes, gpus_per_node=nproc)
    if calibration:
        cluster = apply_calibration(cluster, load_calibration(calibration))
    return cluster


def auto_plan(path: str | None, overrides: list[str], nproc: int, nnodes: int, gpu: str,
              calibration: str | None = None) -> AutoPlan:
    """The planner's fastest layout for this job that passes the trainer's preflight. ValueError: one line."""
    from scaletrain.models.registry import model_spec
    from scaletrain.train.preflight import resolve_job

    cfg = load_config(path, overrides)
    world = nproc * nnodes
    spec = model_spec(cfg.model)
    args = spec.shape()
    if args is None:
        raise ValueError(f"--plan auto: the planner cannot model the {spec.family} family (no decoder shape); "
                         f"set the layout with parallel.* instead")
    work = Workload(cfg.model.name, args, cfg.data.seq_len, cfg.train.global_batch_size)
    cluster = local_cluster(gpu, nproc, nnodes, calibration)
    given = explicit_keys(path, overrides)
    p = cfg.parallel
    # on a CPU host bf16 is no faster (the catalog's CPU entry has equal rates) and fp32 is the trainer's default
    precisions = (cfg.precision.dtype,) if "precision.dtype" in given else \
        (("fp32",) if gpu == "cpu" else ("bf16", "fp32"))
    opts = SearchOptions(
        precisions=precisions,
        ac_modes=(p.activation_checkpoint,) if "parallel.activation_checkpoint" in given else AC_MODES,
        schedules=(p.pp_schedule,) if "parallel.pp_schedule" in given else PP_SCHEDULES,
        cp=(1,),  # the trainer has no context parallelism
        max_micro_batch=max(16, cfg.train.micro_batch_size or 1),
        top=10_000)
    result = search_layouts(work, cluster, opts)
    for n, row in enumerate(result.rows, 1):
        try:
            plan = layout_overrides(row.layout)
        except ValueError:
            continue
        # a plan the user's own settings would change is not the plan that runs
        mine = {".".join(parse_override(o)[0]): parse_override(o)[1] for o in plan}
        if any(k in given and getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1]) != v
               for k, v in mine.items()):
            continue
        try:
            resolve_job(load_config(path, [*plan, *overrides]), world)
        except ValueError:
            continue
        return AutoPlan(row, plan, cluster, n)
    raise ValueError(f"--plan auto: no layout of {work.model_name} (seq {work.seq_len}, global batch "
                     f"{work.global_batch}) fits and runs on {world} x {cluster.gpu.name} with the settings given; "
                     f"try `scaletrain plan` for why")
