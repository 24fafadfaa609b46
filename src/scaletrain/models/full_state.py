"""Filling a model (whole, or sharded by FSDP or TP: DTensor parameters) from a full state dict on every rank:
each rank keeps its shard of each tensor. Memory: the full state on every rank, so for models a rank can hold
whole (a vision classifier read from its folder, a user's own module built by its factory)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from scaletrain.models.naming import plain_param_name


def copy_full_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` (plain names -> full tensors) into the parameters and persistent buffers of `model`;
    KeyError names a tensor of the model that `state` lacks."""
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():  # parameters and persistent buffers
            clean = plain_param_name(name)
            if clean not in state:
                raise KeyError(f"{clean}: not in the weights")
            full = state[clean].to(t.dtype)
            if isinstance(t, DTensor):
                t.to_local().copy_(distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None).to_local())
            else:
                t.copy_(full)
