"""`scaletrain.setup()`: bring your own model, optimizer and loop; scaletrain handles the process group, the
device, the data-parallel wrapping and the step mechanics (autocast, accumulation, loss scaling, clipping).

    import scaletrain
    job = scaletrain.setup(model, optimizer, data_parallel="fsdp", precision="bf16", grad_clip=1.0)
    for inputs, targets in my_loader:            # each rank feeds its own share of the data
        with job.autocast():
            loss = loss_fn(job.model(inputs.to(job.device)), targets.to(job.device))
        job.backward(loss)
        job.step()                                # unscale, clip, optimizer step, zero_grad

Run it with `torchrun --nproc-per-node N my_script.py`, or as a plain `python my_script.py` (one rank).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from scaletrain.config.precisions import PrecisionName
from scaletrain.config.schema import ParallelConfig, PrecisionConfig
from scaletrain.parallel.apply import apply_parallelism
from scaletrain.parallel.dims import ParallelDims, build_mesh
from scaletrain.parallel.runtime import init_distributed, pick_device_type
from scaletrain.train.job import Job, rebind_optimizer

DataParallel = Literal["auto", "none", "ddp", "fsdp", "hsdp"]


def _parallel_config(
    data_parallel: DataParallel, world: int, dp_replicate: int | None, reshard_after_forward: bool
) -> ParallelConfig:
    mode = data_parallel
    if mode == "auto":
        mode = "ddp" if world > 1 else "none"
    if mode == "none":
        if world > 1:
            raise ValueError(f"data_parallel='none' on {world} ranks: pick 'ddp', 'fsdp' or 'hsdp'")
        return ParallelConfig(dp_replicate=1, dp_shard=1)
    if mode == "ddp":
        return ParallelConfig(dp_replicate=world, dp_shard=1)
    if mode == "fsdp":
        return ParallelConfig(dp_replicate=1, dp_shard=world, fsdp_reshard_after_forward=reshard_after_forward)
    if mode == "hsdp":
        if not dp_replicate or dp_replicate < 2 or world % dp_replicate:
            raise ValueError(
                f"dp_replicate: HSDP needs a replica count >= 2 dividing the world size {world} (got {dp_replicate})"
            )
        return ParallelConfig(
            dp_replicate=dp_replicate, dp_shard=world // dp_replicate, fsdp_reshard_after_forward=reshard_after_forward
        )
    raise ValueError(f"data_parallel: unknown mode {data_parallel!r}; use auto, none, ddp, fsdp or hsdp")


def setup(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    data_parallel: DataParallel = "auto",
    precision: PrecisionName = "fp32",
    dp_replicate: int | None = None,
    reshard_after_forward: bool = True,
    fsdp_accumulate: Literal["sharded", "unsharded"] = "sharded",
    grad_clip: float = 0.0,
    device: Literal["auto", "cpu", "cuda"] = "auto",
    timeout_s: float = 600.0,
) -> Job:
    """Join the process group, move and wrap `model` for the chosen data parallelism, and return a Job.

    data_parallel: 'auto' (DDP on several ranks, nothing on one), 'ddp', 'fsdp' (FSDP2, every block sharded),
    'hsdp' (FSDP2 inside groups of world/dp_replicate ranks, replicated across dp_replicate groups).
    precision: compute dtype; master weights and optimizer states stay fp32; fp16 adds loss scaling.
    fsdp_accumulate: under FSDP/HSDP, 'sharded' reduce-scatters even inside accumulate(sync=False), keeping
    gradients sharded (memory / ranks); 'unsharded' holds whole gradients until sync=True.
    grad_clip: max global L2 norm of the gradients (0: no clipping). Returns job with .model, .optimizer, .device,
    .rank, .world_size, .dp_rank, .autocast(), .accumulate(sync), .backward(loss), .step().
    """
    rt = init_distributed(pick_device_type(device), timeout_s)
    pcfg = _parallel_config(data_parallel, rt.world_size, dp_replicate, reshard_after_forward)
    dims = ParallelDims.resolve(pcfg, rt.world_size)
    mesh = build_mesh(dims, rt.device.type)
    names = {id(p): n for n, p in model.named_parameters()}
    laid_out = apply_parallelism(model, dims, mesh, rt.device, pcfg, PrecisionConfig(dtype=precision))
    if any(id(p) not in names for p in laid_out.module.parameters()):
        optimizer = rebind_optimizer(optimizer, names, laid_out.module)
    return Job.for_model(laid_out, optimizer, dims, mesh, rt, precision, grad_clip, fsdp_accumulate=fsdp_accumulate)
