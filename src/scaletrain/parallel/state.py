"""The full (unsharded) parameters of a parallelised model, named as in the plain single-process model: for
comparing layouts, exporting, or handing weights to code that knows nothing of meshes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from scaletrain.models.naming import plain_param_name
from scaletrain.parallel.pipeline import PipelinedModel


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """{plain name: full tensor on CPU} of the parameters this rank holds: the whole model, or under pipeline
    parallelism this rank's stages. Sharded parameters (FSDP2, TP) are gathered over their mesh, so every rank of
    a stage must call this (a collective). Memory: the stage's full parameters. A 4-bit base weight is given
    dequantized, in its dtype."""
    parts = list(model) if isinstance(model, PipelinedModel) else [model]
    return {name: tensor for part in parts for name, tensor in gathered_weights(part, keep=True)}


def gathered_weights(module: nn.Module, keep: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(plain name, whole plain tensor on CPU) of each weight of `module`, one gathered at a time (a collective:
    every rank of its mesh iterates to the end); with keep=False nothing is yielded on this rank (it only takes
    part in the gathers). Each rank's shard is made plain before the gather: fp8's wrappers unwrapped, a 4-bit
    base (QLoRA) dequantized, so only plain tensors cross the ranks (torchao's NF4 tensor is gathered by FSDP2's
    own hooks, not by DTensor's redistribute; its clone() also quantizes again, lossily)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from scaletrain.models.lora import dequantized
    from scaletrain.parallel.float8 import plain_weights

    from scaletrain.parallel.embedding import broadcast_tables, rank_local_params

    local = {id(p) for p in rank_local_params(module)}  # table-wise tables: each on its owner, broadcast below
    named = {plain_param_name(n): p for n, p in module.named_parameters()}
    state = dequantized(plain_weights(get_model_state_dict(module)))  # this rank's shards
    for name, value in state.items():
        if local and id(named.get(plain_param_name(name))) in local:
            continue
        tensor: Any = value  # a DTensor (sharded by FSDP/TP) or a plain tensor
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        if keep:
            yield plain_param_name(name), tensor.detach().cpu().clone()
        del tensor
    for name, table in broadcast_tables(module):
        if keep:
            yield plain_param_name(name), table
