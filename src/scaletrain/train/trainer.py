"""The trainer, built from parts once: process group, layout, model, optimizer and schedule, data. It knows how to
take one optimizer step (`train_step`), evaluate, and hand its state to a checkpoint; the loop around it (loop.py)
adds checkpointing, monitoring, preemption and hang detection. Tests and benchmarks build the same Trainer.

Loss normalisation: each optimizer step counts N units in all, as the task counts them (tasks/: B·S target tokens
for causal-lm). A rank's micro-batch loss is the task's summed loss × (data-parallel degree / N), so the
data-parallel gradient average yields exactly the gradient of the mean over all N units: accumulation k×b equals
one batch of k·b, and any layout equals one process. Under context parallelism the gradient reduction also averages
over the cp ranks (each holding a cp-th of every sequence), so the scale counts them too (Layout.grad_average).
The trainer names no task: `cfg.task` picks it (tasks/registry.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from scaletrain.config.layout import Layout
from scaletrain.config.schema import JobConfig
from scaletrain.data import DistributedLoader
from scaletrain.models.spec import ModelSpec
from scaletrain.monitor import log
from scaletrain.monitor.timing import NULL_TIMER
from scaletrain.parallel import (
    ParallelModel,
    ParallelPlan,
    Runtime,
    apply_parallelism,
    build_mesh,
    init_distributed,
    pick_device_type,
)
from scaletrain.train.job import Job
from scaletrain.train.optim import build_optimizer, build_scheduler
from scaletrain.train.fingerprint import check_same_job
from scaletrain.resolve import ResolvedJob, resolve_job, settle_device_defaults
from scaletrain.tasks import Task, task_for
from scaletrain.train.step import evaluate, forward_backward, step_count, sum_over_ranks


class NonFiniteError(RuntimeError):
    """The loss or gradient became NaN/Inf and the nan policy says stop."""


@dataclass
class StepResult:
    loss_sum: torch.Tensor  # this rank's share of the step's summed loss (not yet reduced over ranks)
    grad_norm: torch.Tensor  # global gradient norm before clipping
    lr: float  # learning rate the step used
    count: float = 0.0  # units the step's loss sums over, every rank together (the task's count, e.g. tokens)


def build_model(cfg: JobConfig, resolved: ResolvedJob, mesh, rt: Runtime) -> ParallelModel:
    """The job's model from its spec, built on meta and laid out for the mesh (weights filled by name)."""
    spec, seed = resolved.spec, cfg.run.seed
    plan = ParallelPlan(resolved.layout, cfg.parallel, cfg.precision, spec, seq_len=cfg.data.seq_len)
    model = spec.build("meta")
    if not cfg.lora.rank:
        return apply_parallelism(model, plan, mesh, rt.device, lambda m: spec.init_weights(m, seed))
    from scaletrain.models.lora import add_lora, fill_base, init_adapters

    # adapters go on before any layout step (the apply order then lays out the adapted model as any other)
    model = add_lora(model, cfg.lora, spec)

    def init(m) -> None:
        fill_base(m, lambda whole: spec.init_weights(whole, seed))  # by name or from model.hf's folder; nf4 after
        init_adapters(m, seed)

    return apply_parallelism(model, plan, mesh, rt.device, init)


def build_loaders(
    cfg: JobConfig, resolved: ResolvedJob, dp_rank: int, dp_size: int, task: Task | None = None
) -> tuple[DistributedLoader, DistributedLoader]:
    """(training loader, validation loader) of this data-parallel rank, as the job's task reads its data. The data
    needs no check here: `resolved` comes from resolve_job, which had the task check it against the model.
    task: the instance that then counts the batches (its data may decide what it counts: Task.counts_vary)."""
    task = task or task_for(cfg.task)
    return task.loaders(cfg, resolved.spec, resolved.layout.micro_batch, dp_rank, dp_size)


@dataclass
class Trainer:
    cfg: JobConfig
    rt: Runtime
    resolved: ResolvedJob
    mesh: object
    model: ParallelModel
    job: Job
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: DistributedLoader
    val_loader: DistributedLoader
    skipped_steps: int = 0

    @classmethod
    def build(cls, cfg: JobConfig, rt: Runtime | None = None) -> Trainer:
        """Join the process group (unless `rt` is given), check the job, and build every part once."""
        device_type = pick_device_type(cfg.run.device)
        cfg = settle_device_defaults(cfg, device_type)  # dtype and compile "auto" as this device decides them
        if rt is None:
            rt = init_distributed(device_type, cfg.launch.collective_timeout_s, cfg.launch.rdzv_endpoint)
        check_same_job(cfg, cfg.launch.collective_timeout_s)  # every node runs this job: before any collective
        resolved = resolve_job(cfg, rt.world_size)
        mesh = build_mesh(resolved.layout, device_type)
        model = build_model(cfg, resolved, mesh, rt)
        optimizer = build_optimizer(model.module, cfg.train)
        job = Job.for_model(model, optimizer, rt, cfg.train.grad_clip)
        task = task_for(cfg.task)
        loader, val_loader = build_loaders(cfg, resolved, job.dp_rank, job.dp_size, task)
        trainer = cls(cfg, rt, resolved, mesh, model, job, build_scheduler(optimizer, cfg.train), loader, val_loader)
        trainer.__dict__["task"] = task  # the instance that read the data counts its batches (the cached task)
        return trainer

    @property
    def spec(self) -> ModelSpec:
        return self.resolved.spec

    @property
    def layout(self) -> Layout:
        return self.resolved.layout

    @cached_property
    def task(self) -> Task:
        """What the job trains the model to do (its batch, loss, count and evaluation)."""
        return task_for(self.cfg.task)

    def slowest(self, seconds: float) -> float:
        """The largest of every rank's `seconds` (a collective: every rank calls it)."""
        if self.rt.world_size == 1:
            return seconds
        t = torch.tensor([seconds], dtype=torch.float64, device=self.rt.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return float(t.item())

    def train_step(self, step: int, timer=NULL_TIMER, beat=None) -> StepResult:
        """One optimizer step `step` (1-based): forward and backward over this rank's micro-batches, clip, update,
        advance the schedule. A non-finite gradient norm skips the update or raises NonFiniteError, per
        train.nan_policy. timer: the monitor's phase timer; beat(step, phase): told as each phase starts."""
        beat = beat or (lambda step, phase: None)
        beat(step, "data")
        with timer.phase("data"):
            micro_batches = self.loader.next_step()
        beat(step, "forward/backward")
        count = step_count(self.job, self.task, micro_batches)
        scale = self.layout.grad_average / count  # dp (x cp): the ranks gradients average over
        loss_sum = forward_backward(self.job, self.task, micro_batches, scale, timer=timer)
        policy = self.cfg.train.nan_policy
        beat(step, "optimizer")
        with timer.phase("optimizer"):
            grad_norm = self.job.step(skip_nonfinite=policy == "skip")
        if not torch.isfinite(grad_norm) and self.job.scaler is None:
            # the norm decides; the loss (finite or not) says whether forward or only backward blew up
            loss = self.mean_loss(loss_sum, count)
            what = "loss" if not math.isfinite(loss) else "gradient norm"
            values = f"loss {loss:.6g}, gradient norm {float(grad_norm):.6g}"
            self.skipped_steps += 1
            if policy == "stop" or self.skipped_steps > self.cfg.train.max_skipped_steps:
                raise NonFiniteError(
                    f"step {step}: {what} is not finite ({values}; train.nan_policy={policy}, "
                    f"{self.skipped_steps} step(s) skipped); stopping: lower train.lr or set "
                    f"train.grad_clip"
                )
            log.warning(
                "step %d: %s is not finite (%s), update skipped (%d/%d)",
                step,
                what,
                values,
                self.skipped_steps,
                self.cfg.train.max_skipped_steps,
            )
        lr = float(self.scheduler.get_last_lr()[0])
        self.scheduler.step()
        return StepResult(loss_sum, grad_norm, lr, count)

    def mean_loss(self, loss_sum: torch.Tensor, count: float) -> float:
        """The step's mean loss per counted unit over every rank (a blocking all-reduce); count: StepResult.count."""
        return sum_over_ranks(loss_sum) / count

    def evaluate(self) -> dict[str, float]:
        """The task's metrics (val_loss, ...) over train.eval_batches global batches of the validation split."""
        return evaluate(self.job, self.task, self.val_loader, self.cfg.train.eval_batches)

    def state_dict(self) -> dict:
        """The trainer's own state for a checkpoint (plain JSON-able data, world-size free)."""
        scaler = self.job.scaler
        return {
            "scheduler": self.scheduler.state_dict(),
            "loader": self.loader.state_dict(),
            "skipped_steps": self.skipped_steps,
            "scaler": scaler.state_dict() if scaler is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        # the schedule's position; its per-group lists stay this run's: the optimizer's group count depends on the
        # layout (plain and DTensor weights are grouped apart: train/optim.py), and a checkpoint may come from another
        scheduler = {k: v for k, v in state["scheduler"].items() if k not in ("base_lrs", "_last_lr")}
        self.scheduler.load_state_dict({**self.scheduler.state_dict(), **scheduler})
        self.loader.load_state_dict(state["loader"])
        self.skipped_steps = state.get("skipped_steps", 0)
        if self.job.scaler is not None and state.get("scaler"):
            self.job.scaler.load_state_dict(state["scaler"])
