"""One optimizer step's forward and backward over a rank's micro-batches, and evaluation.

Kept apart from the loop so a layout that changes how forward/backward run (a pipeline schedule) changes only
this file.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from scaletrain.data import Batch, DistributedLoader
from scaletrain.train.job import Job


def sum_over_ranks(value: torch.Tensor) -> float:
    """Sum of a scalar over all ranks (a blocking all-reduce), as a Python float."""
    value = value.detach().float().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
    return value.item()


def token_loss_sum(job: Job, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over every target token of the micro-batch (logits in fp32)."""
    with job.autocast():
        logits = job.model(inputs.to(job.device, non_blocking=True))
    return F.cross_entropy(logits.float().flatten(0, 1), targets.to(job.device).flatten(), reduction="sum")


def forward_backward(job: Job, micro_batches: list[Batch], loss_scale: float) -> torch.Tensor:
    """Accumulate gradients of loss_scale × summed token loss over the micro-batches, reducing gradients across
    ranks only on the last one. Returns this rank's summed token loss (no sync)."""
    loss_sum = torch.zeros((), device=job.device)
    for i, mb in enumerate(micro_batches):
        with job.accumulate(sync=i == len(micro_batches) - 1):
            loss = token_loss_sum(job, mb.inputs, mb.targets)
            job.backward(loss * loss_scale)
        loss_sum += loss.detach()
    return loss_sum


@torch.no_grad()
def evaluate(job: Job, loader: DistributedLoader, batches: int, tokens_per_batch: int) -> float:
    """Mean token loss over the first `batches` global batches of the validation stream."""
    loader.consumed_samples = 0
    total = torch.zeros((), device=job.device)
    for _ in range(batches):
        for mb in loader.next_step():
            total += token_loss_sum(job, mb.inputs, mb.targets)
    return sum_over_ranks(total) / (batches * tokens_per_batch)
