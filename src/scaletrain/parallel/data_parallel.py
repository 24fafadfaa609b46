"""Data parallelism: DDP (bucketed, overlapping the all-reduce with backward), FSDP2 (`fully_shard`) and HSDP.

FSDP2 shards each unit (parallel/blocks.py `fsdp_units`: the blocks, or the modules the user names; a model
without a block container: its direct children holding parameters) and then the root, so one block's all-gather
overlaps the previous block's compute.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from scaletrain.config.precisions import MASTER_DTYPE, PRECISIONS
from scaletrain.models.spec import ModelSpec
from scaletrain.parallel.blocks import ShardRule, fsdp_units
from scaletrain.config.layout import Layout
from scaletrain.parallel.dims import expert_fsdp_mesh, experts_apart, fsdp_mesh

DTYPES = {p.name: getattr(torch, p.torch_dtype) for p in PRECISIONS}


def sharded_table_params(model: nn.Module) -> list[nn.Parameter]:
    from scaletrain.parallel.embedding import sharded_tables

    return [p for tables in sharded_tables(model) for p in tables.local_tables()]


def _batch_norms(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, _BatchNorm) and any(True for _ in m.parameters())]


def apply_fsdp(
    model: nn.Module,
    mesh,
    layout: Layout,
    dtype: str,
    reduce_dtype: str,
    reshard_after_forward: bool,
    spec: ModelSpec | None = None,
    shard: ShardRule | None = None,
    cpu_offload: bool = False,
) -> nn.Module:
    """Shard `model` in place: each unit of `fsdp_units(model, spec, shard)`, then the root.

    With a compute dtype below fp32, every BatchNorm becomes its own unit computing in fp32 (its running
    statistics are fp32 buffers, which batch_norm will not mix with bf16/fp16 weights), its output cast back to the
    compute dtype. Running statistics stay per rank (not synchronised), as DDP without buffer broadcast.
    cpu_offload: FSDP2's CPUOffloadPolicy on every unit (sharded parameters, gradients and optimizer states in host
    memory, pinned when there is a GPU to copy to).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    dp_mesh = fsdp_mesh(layout, mesh)
    if dtype == MASTER_DTYPE:
        mp = MixedPrecisionPolicy()
        norms: list[nn.Module] = []
    else:
        mp = MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=DTYPES[reduce_dtype])
        norms = _batch_norms(model)
        fp32 = DTYPES[MASTER_DTYPE]
        norm_mp = MixedPrecisionPolicy(param_dtype=fp32, reduce_dtype=fp32, output_dtype=DTYPES[dtype])
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    for norm in norms:  # leaves: safe to shard before any unit that holds them
        fully_shard(
            norm, mesh=dp_mesh, mp_policy=norm_mp, reshard_after_forward=reshard_after_forward, offload_policy=offload
        )
    done = {id(m) for m in norms}
    # modules that also run outside their block (e.g. a DiT's first-block embedding): their own units, gathered
    # whenever they run; nested in their block's unit, whose fully_shard then leaves their weights to them
    for module in spec.called_outside_their_block(model) if spec is not None else []:
        fully_shard(
            module, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, offload_policy=offload
        )
        done.add(id(module))
    # experts first, over the ranks holding the same ones (parallel/expert.py)
    if experts_apart(layout) and spec is not None and spec.splits_experts:
        from scaletrain.parallel.expert import shard_experts

        shard_experts(
            spec.expert_modules(model),
            expert_fsdp_mesh(layout, mesh),
            layout.grad_average,
            mp_policy=mp,
            reshard_after_forward=reshard_after_forward,
            offload_policy=offload,
        )
    units = fsdp_units(model, spec, shard)
    for i, unit in enumerate(units):
        if isinstance(unit, list):
            unit = [m for m in unit if id(m) not in done]
            if not unit:
                continue
        elif id(unit) in done:
            continue
        # the last block (in model order; pipelines excepted, whose micro-batches all run forward first) would be
        # all-gathered again as soon as backward starts: keeping it gathered saves one all-gather per step, as
        # torchtitan does
        last_block = shard is None and layout.pp == 1 and i == len(units) - 1
        fully_shard(
            unit,
            mesh=dp_mesh,
            mp_policy=mp,
            reshard_after_forward=reshard_after_forward and not last_block,
            offload_policy=offload,
        )
    # the root's params (embeddings, head) are used last in backward: keeping them gathered saves one all-gather;
    # embedding tables sharded over the ranks (parallel/embedding.py) are left out: their rows are split already
    tables = set(sharded_table_params(model)) or None
    fully_shard(
        model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False, offload_policy=offload, ignored_params=tables
    )
    return model


def apply_ddp(model: nn.Module, mesh, device: torch.device, bucket_cap_mb: float) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    from scaletrain.models.lora import quantized_base_names

    group = mesh["dp_replicate"].get_group()
    ids = [device.index] if device.type == "cuda" else None
    # DDP's start-up broadcast of every weight garbles a 4-bit base (NF4's packed parts are not sent whole); every
    # rank quantized the same weights itself (models/lora.py fill_base), so they are left out of it
    quantized = quantized_base_names(model)
    # embedding tables sharded over the ranks (parallel/embedding.py) differ per rank: not broadcast, not averaged
    names = {id(p): n for n, p in model.named_parameters()}
    ignored = quantized + [names[id(p)] for p in sharded_table_params(model)]
    if ignored:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    return DistributedDataParallel(model, process_group=group, device_ids=ids, bucket_cap_mb=bucket_cap_mb)


def uses_autocast(layout: Layout, dtype: str) -> bool:
    """FSDP2 casts parameters itself (MixedPrecisionPolicy); DDP and single-rank runs use autocast."""
    return dtype != MASTER_DTYPE and not layout.mode.sharded
