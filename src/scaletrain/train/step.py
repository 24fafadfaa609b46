"""One optimizer step's forward and backward over a rank's micro-batches, and evaluation, for any task.

Kept apart from the loop so a layout that changes how forward/backward run changes only this file: under pipeline
parallelism the schedule replaces the micro-batch loop. What is fed to the model, the loss and what it is
normalised by are the task's (tasks/): this file only runs them on the layout.

Loss reporting: every rank returns its share of the summed loss, and exactly one rank per data-parallel coordinate
holds it (the last pipeline stage's first tensor-parallel rank; the others return 0), so one sum over all ranks
counts every unit once. Under context parallelism each cp rank holds the loss of its own part of the sequences
(Job.shard_sequence), and the same sum still counts every unit once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from scaletrain.monitor.timing import NULL_TIMER
from scaletrain.tasks.base import Task
from scaletrain.train.job import Job


def sum_over_ranks(value: torch.Tensor) -> float:
    """Sum of a scalar over all ranks (a blocking all-reduce), as a Python float."""
    value = value.detach().float().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
    return value.item()


def _summed_statistic(value: torch.Tensor) -> float | list[float]:
    """An evaluation statistic summed over all ranks: a float for a scalar, a list for a vector (a histogram)."""
    if value.numel() == 1:
        return sum_over_ranks(value)
    value = value.detach().float().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
    return value.flatten().tolist()


def step_count(job: Job, task: Task, micro_batches: list) -> float:
    """The units (task.count) of one step over every data-parallel rank: what the step's summed loss is divided
    by. Every rank of a data-parallel coordinate reads the same batch; a task whose counts vary with the batch's
    content pays one all-reduce (the sum over all ranks counts each coordinate world/dp times)."""
    local = sum(task.count(mb) for mb in micro_batches)
    if not task.counts_vary or job.world_size == 1:
        return float(local * job.dp_size)
    total = torch.tensor(local, dtype=torch.int64, device=job.device)  # exact at any count
    dist.all_reduce(total)
    return float(total.item() * job.dp_size // job.world_size)


def _loss_context(job: Job):
    """With loss parallelism the logits stay sharded over the vocabulary; cross-entropy and its backward must both
    run under torch's loss_parallel()."""
    if job.loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def _local(loss: torch.Tensor) -> torch.Tensor:
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


def _shard(job: Job, task: Task, tensor: torch.Tensor) -> torch.Tensor:
    return job.shard_sequence(tensor) if task.sequences else tensor


def _inputs(task: Task, batch: Any) -> tuple[torch.Tensor, ...]:
    inputs = task.inputs(batch)
    return inputs if isinstance(inputs, tuple) else (inputs,)


def _kwargs(job: Job, task: Task, batch: Any) -> dict[str, torch.Tensor]:
    return {k: _shard(job, task, x).to(job.device, non_blocking=True) for k, x in task.forward_kwargs(batch).items()}


def loss_sum(job: Job, task: Task, batch: Any, sums: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The task's summed loss of one micro-batch through the model (forward under autocast; loss in fp32).
    sums: when given, the task's evaluation statistics of the batch (task.eval_sums) are added into it."""
    inputs = [_shard(job, task, x).to(job.device, non_blocking=True) for x in _inputs(task, batch)]
    with job.autocast():
        outputs = job.model(*inputs, **_kwargs(job, task, batch))
    targets = _shard(job, task, task.targets(batch)).to(job.device)
    if sums is not None:
        for key, value in task.eval_sums(outputs, targets).items():
            sums[key] = sums.get(key, 0) + value.detach().float()
    return task.loss_sum(outputs, targets)


def _owned(job: Job, loss: torch.Tensor) -> torch.Tensor:
    return loss if job.owns_loss else torch.zeros_like(loss)


def _whole(
    micro_batches: list, job: Job, task: Task
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, dict[str, torch.Tensor]]:
    """The rank's micro-batches as one batch (the pipeline schedule splits it again): (model inputs, targets,
    forward keyword arguments)."""
    columns = zip(*(_inputs(task, mb) for mb in micro_batches), strict=True)
    inputs = tuple(_shard(job, task, torch.cat(col).to(job.device)) for col in columns)
    targets = torch.cat([task.targets(mb) for mb in micro_batches]).to(job.device)
    per_mb = [task.forward_kwargs(mb) for mb in micro_batches]
    kwargs = {k: _shard(job, task, torch.cat([kw[k] for kw in per_mb]).to(job.device)) for k in per_mb[0]}
    return inputs, _shard(job, task, targets), kwargs


def forward_backward(
    job: Job,
    task: Task,
    micro_batches: list,
    loss_scale: float,
    timer=NULL_TIMER,
    after_backward: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Accumulate gradients of loss_scale × the task's summed loss over the micro-batches, reducing gradients
    across ranks on the last one (FSDP's sharded accumulation: on every one). Returns this rank's share of the
    summed loss (no sync).
    timer: the monitor's StepTimer; its phases time forward and backward (a pipeline schedule as one "fb").
    after_backward(i): called after micro-batch i's backward (not under a pipeline schedule), e.g. to measure."""
    if job.pipeline is not None:
        # the schedule splits the rank's batch into the same micro-batches and interleaves their passes
        with timer.phase("fb"), job.autocast():
            inputs, targets, kwargs = _whole(micro_batches, job, task)
            return _owned(job, job.pipeline.step(inputs, targets, loss_scale, task.loss_sum, kwargs))
    total = torch.zeros((), device=job.device)
    for i, mb in enumerate(micro_batches):
        with job.accumulate(sync=i == len(micro_batches) - 1), _loss_context(job):
            with timer.phase("forward"):
                loss = loss_sum(job, task, mb)
            with timer.phase("backward"):
                job.backward(loss * loss_scale)
        if after_backward is not None:
            after_backward(i)
        total += _local(loss.detach())
    return _owned(job, total)


@torch.no_grad()
def evaluate(job: Job, task: Task, loader, batches: int) -> dict[str, float]:
    """The task's metrics over the first `batches` global batches of the validation stream (its summed loss and
    count over every rank: task.eval_metrics)."""
    loader.consumed_samples = 0
    total = torch.zeros((), device=job.device)
    count = 0.0
    sums: dict[str, torch.Tensor] = {}  # the task's eval_sums (not under a pipeline schedule)
    for _ in range(batches):
        micro_batches = loader.next_step()
        count += step_count(job, task, micro_batches)
        if job.pipeline is not None:
            with job.autocast():
                inputs, targets, kwargs = _whole(micro_batches, job, task)
                total += job.pipeline.evaluate(inputs, targets, task.loss_sum, kwargs)
            continue
        for mb in micro_batches:
            with _loss_context(job):
                total += _local(loss_sum(job, task, mb, sums))
    loss = sum_over_ranks(_owned(job, total))
    if not sums:
        return task.eval_metrics(loss, count)
    # every rank of a data-parallel coordinate holds the same statistics: count each coordinate once
    owned = {key: _summed_statistic(_owned(job, value)) for key, value in sorted(sums.items())}
    return task.eval_metrics(loss, count, owned)  # type: ignore[call-arg]
