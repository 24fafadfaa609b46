"""One optimizer step's forward and backward over a rank's micro-batches, and evaluation.

Kept apart from the loop so a layout that changes how forward/backward run changes only this file: under pipeline
parallelism the schedule replaces the micro-batch loop.

Loss reporting: every rank returns its share of the summed token loss, and exactly one rank per data-parallel
coordinate holds it (the last pipeline stage's first tensor-parallel rank; the others return 0), so one sum over
all ranks counts every token once. Under context parallelism each cp rank holds the loss of its own part of the
sequences (Job.shard_sequence), and the same sum still counts every token once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from scaletrain.data import Batch, DistributedLoader
from scaletrain.models.loss import token_loss_sum as _token_loss_sum
from scaletrain.monitor.timing import NULL_TIMER
from scaletrain.train.job import Job


def sum_over_ranks(value: torch.Tensor) -> float:
    """Sum of a scalar over all ranks (a blocking all-reduce), as a Python float."""
    value = value.detach().float().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
    return value.item()


def _loss_context(job: Job):
    """With loss parallelism the logits stay sharded over the vocabulary; cross-entropy and its backward must both
    run under torch's loss_parallel()."""
    if job.loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def _local(loss: torch.Tensor) -> torch.Tensor:
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


def token_loss_sum(job: Job, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over every target token of the micro-batch (logits in fp32)."""
    inputs, targets = job.shard_sequence(inputs), job.shard_sequence(targets)
    with job.autocast():
        logits = job.model(inputs.to(job.device, non_blocking=True))
    return _token_loss_sum(logits, targets.to(job.device))


def _owned(job: Job, loss_sum: torch.Tensor) -> torch.Tensor:
    return loss_sum if job.owns_loss else torch.zeros_like(loss_sum)


def _whole(micro_batches: list[Batch], job: Job) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = torch.cat([mb.inputs for mb in micro_batches]).to(job.device)
    targets = torch.cat([mb.targets for mb in micro_batches]).to(job.device)
    return job.shard_sequence(inputs), job.shard_sequence(targets)


def forward_backward(
    job: Job,
    micro_batches: list[Batch],
    loss_scale: float,
    timer=NULL_TIMER,
    after_backward: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Accumulate gradients of loss_scale × summed token loss over the micro-batches, reducing gradients across
    ranks on the last one (FSDP's sharded accumulation: on every one). Returns this rank's share of the summed
    token loss (no sync).
    timer: the monitor's StepTimer; its phases time forward and backward (a pipeline schedule as one "fb").
    after_backward(i): called after micro-batch i's backward (not under a pipeline schedule), e.g. to measure."""
    if job.pipeline is not None:
        # the schedule splits the rank's batch into the same micro-batches and interleaves their passes
        with timer.phase("fb"), job.autocast():
            return _owned(job, job.pipeline.step(*_whole(micro_batches, job), loss_scale))
    loss_sum = torch.zeros((), device=job.device)
    for i, mb in enumerate(micro_batches):
        with job.accumulate(sync=i == len(micro_batches) - 1), _loss_context(job):
            with timer.phase("forward"):
                loss = token_loss_sum(job, mb.inputs, mb.targets)
            with timer.phase("backward"):
                job.backward(loss * loss_scale)
        if after_backward is not None:
            after_backward(i)
        loss_sum += _local(loss.detach())
    return _owned(job, loss_sum)


@torch.no_grad()
def evaluate(job: Job, loader: DistributedLoader, batches: int, tokens_per_batch: int) -> float:
    """Mean token loss over the first `batches` global batches of the validation stream."""
    loader.consumed_samples = 0
    total = torch.zeros((), device=job.device)
    for _ in range(batches):
        micro_batches = loader.next_step()
        if job.pipeline is not None:
            with job.autocast():
                total += job.pipeline.evaluate(*_whole(micro_batches, job))
            continue
        for mb in micro_batches:
            with _loss_context(job):
                total += _local(token_loss_sum(job, mb.inputs, mb.targets))
    return sum_over_ranks(_owned(job, total)) / (batches * tokens_per_batch)
