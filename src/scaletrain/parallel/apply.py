"""Applying a layout to a model, in one fixed order:
pipeline split → tensor (+ sequence) parallel → activation checkpointing → compile → FSDP2 / DDP.

Each step works on the meta-device model; it is materialised at the right moment: after FSDP sharding (each rank
allocates only its shard), before DDP (which broadcasts rank 0's weights at construction). TP before FSDP makes
FSDP shard the TP shards (2-D DTensors); AC and compile wrap whole blocks before FSDP so that FSDP still sees one
unit per block.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from scaletrain.config.schema import ParallelConfig, PrecisionConfig
from scaletrain.parallel.activation_checkpoint import apply_activation_checkpointing
from scaletrain.parallel.compile import apply_compile
from scaletrain.parallel.data_parallel import apply_ddp, apply_fsdp
from scaletrain.parallel.dims import ParallelDims
from scaletrain.parallel.pipeline import (PipelinedModel, build_pipeline, layer_costs, split_layers, stage_module,
                                          stages_of_rank)
from scaletrain.parallel.tensor_parallel import TPOptions, apply_tensor_parallel


def _on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _materialize(model: nn.Module, device: torch.device, init_fn: Callable[[nn.Module], None] | None) -> None:
    if _on_meta(model):
        if init_fn is None:
            raise ValueError("model is on the meta device but no init function was given to fill its weights")
        model.to_empty(device=device)
        init_fn(model)
    else:
        model.to(device)


def _parallelize(model: nn.Module, dims: ParallelDims, mesh, device: torch.device, parallel: ParallelConfig,
                 precision: PrecisionConfig, init_fn: Callable[[nn.Module], None] | None) -> nn.Module:
    """TP → AC → compile → FSDP/DDP on one model (or one pipeline stage of it)."""
    if dims.tp > 1:
        loss_parallel = parallel.loss_parallel and dims.pp == 1 and parallel.tp_plan == "model" \
            and getattr(model, "output", None) is not None
        apply_tensor_parallel(model, mesh["tp"], TPOptions(parallel.sequence_parallel, loss_parallel),
                              parallel.tp_plan)
        model.loss_parallel = loss_parallel  # read by the training step: loss and backward under loss_parallel()
    apply_activation_checkpointing(model, parallel.activation_checkpoint, parallel.ac_selective, parallel.ac_every)
    if parallel.compile:
        apply_compile(model)
    if dims.mode in ("fsdp", "hsdp"):
        model = apply_fsdp(model, mesh, dims, precision.dtype, precision.reduce_dtype,
                           parallel.fsdp_reshard_after_forward)
        _materialize(model, device, init_fn)
        return model
    _materialize(model, device, init_fn)
    if dims.mode == "ddp":
        return apply_ddp(model, mesh, device, parallel.ddp_bucket_cap_mb)
    return model


def apply_parallelism(model: nn.Module, dims: ParallelDims, mesh, device: torch.device, parallel: ParallelConfig,
                      precision: PrecisionConfig, init_fn: Callable[[nn.Module], None] | None = None,
                      microbatches: int = 1, seq_len: int | None = None) -> nn.Module:
    """Return the model wrapped for `dims` on `mesh`, its weights on `device` (filled by init_fn if on meta).

    With pp > 1 the result is a PipelinedModel holding this rank's stages and, as .pipeline, the schedule that
    runs `microbatches` micro-batches per step; the stage split is balanced by the cost of seq_len-token samples.
    """
    if dims.pp == 1:
        return _parallelize(model, dims, mesh, device, parallel, precision, init_fn)
    args = model.args
    n_stages = dims.pp * parallel.stages_per_rank
    costs = layer_costs(args, seq_len or args.max_seq_len)
    bounds = split_layers(costs, n_stages, parallel.pp_balance)
    pp_rank = mesh["pp"].get_local_rank()
    stage_ids = stages_of_rank(pp_rank, dims.pp, n_stages, parallel.pp_schedule)
    parts = [_parallelize(stage_module(model, s, n_stages, bounds[s]), dims, mesh, device, parallel, precision,
                          init_fn) for s in stage_ids]
    pipeline = build_pipeline(parts, stage_ids, n_stages, mesh["pp"], device, parallel.pp_schedule, microbatches)
    pipeline.bounds = bounds
    return PipelinedModel(parts, stage_ids, pipeline)
