"""Applying a layout to a model, in one fixed order: (TP → activation checkpointing → compile) → data parallel.

A model built on the meta device is materialised at the right moment: after FSDP sharding (each rank allocates
only its shard), before DDP (which broadcasts rank 0's weights at construction).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from scaletrain.config.schema import ParallelConfig, PrecisionConfig
from scaletrain.parallel.data_parallel import apply_ddp, apply_fsdp
from scaletrain.parallel.dims import ParallelDims


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


def apply_parallelism(model: nn.Module, dims: ParallelDims, mesh, device: torch.device, parallel: ParallelConfig,
                      precision: PrecisionConfig,
                      init_fn: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """Return the model wrapped for `dims` on `mesh`, its weights on `device` (filled by init_fn if on meta)."""
    if dims.mode in ("fsdp", "hsdp"):
        model = apply_fsdp(model, mesh, dims, precision.dtype, precision.reduce_dtype,
                           parallel.fsdp_reshard_after_forward)
        _materialize(model, device, init_fn)
        return model
    _materialize(model, device, init_fn)
    if dims.mode == "ddp":
        return apply_ddp(model, mesh, device, parallel.ddp_bucket_cap_mb)
    return model
