"""The full (unsharded) parameters of a parallelised model, named as in the plain single-process model: for
comparing layouts, exporting, or handing weights to code that knows nothing of meshes."""

from __future__ import annotations

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
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from scaletrain.models.lora import dequantized

    parts = list(model) if isinstance(model, PipelinedModel) else [model]
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        # a 4-bit base (QLoRA) as the values it computes with: torchao's NF4 clone quantizes again, lossily
        state = dequantized(get_model_state_dict(part, options=StateDictOptions(full_state_dict=True)))
        for name, value in state.items():
            tensor: Any = value  # a DTensor (sharded by FSDP/TP) or a plain tensor
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            out[plain_param_name(name)] = tensor.detach().cpu().clone()
    return out
