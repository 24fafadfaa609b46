"""Data parallelism: DDP (bucketed, overlapping the all-reduce with backward), FSDP2 (`fully_shard`) and HSDP.

FSDP2 shards each block (parallel/blocks.py; a model without a block container: its direct children holding
parameters) and then the root, so one block's all-gather overlaps the previous block's compute.
"""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.config.precisions import MASTER_DTYPE, PRECISIONS
from scaletrain.models.spec import ModelSpec
from scaletrain.parallel.blocks import block_container, block_items
from scaletrain.parallel.dims import ParallelDims

DTYPES = {p.name: getattr(torch, p.torch_dtype) for p in PRECISIONS}


def _units(model: nn.Module, spec: ModelSpec | None) -> list[nn.Module]:
    found = block_container(model, spec)
    if found is not None:
        return [b for _, b in block_items(found[1])]
    return [m for m in model.children() if any(True for _ in m.parameters())]


def apply_fsdp(
    model: nn.Module,
    mesh,
    dims: ParallelDims,
    dtype: str,
    reduce_dtype: str,
    reshard_after_forward: bool,
    spec: ModelSpec | None = None,
    cpu_offload: bool = False,
) -> nn.Module:
    """Shard every block, then the root, over the data-parallel dims of `mesh`. cpu_offload: FSDP2's
    CPUOffloadPolicy on every unit (sharded parameters, gradients and optimizer states in host memory, pinned
    when there is a GPU to copy to)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
    if dtype == MASTER_DTYPE:
        mp = MixedPrecisionPolicy()
    else:
        mp = MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=DTYPES[reduce_dtype])
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    for block in _units(model, spec):
        fully_shard(
            block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, offload_policy=offload
        )
    # the root's params (embeddings, head) are used last in backward: keeping them gathered saves one all-gather
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False, offload_policy=offload)
    return model


def apply_ddp(model: nn.Module, mesh, device: torch.device, bucket_cap_mb: float) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    group = mesh["dp_replicate"].get_group()
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, process_group=group, device_ids=ids, bucket_cap_mb=bucket_cap_mb)


def uses_autocast(dims: ParallelDims, dtype: str) -> bool:
    """FSDP2 casts parameters itself (MixedPrecisionPolicy); DDP and single-rank runs use autocast."""
    return dtype != MASTER_DTYPE and dims.mode not in ("fsdp", "hsdp")
