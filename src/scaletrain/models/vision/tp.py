"""A tensor-parallel style for the modules a ViT's plan does not split (patch embedding, norms, head): their
parameters become replicated DTensors, so every parameter of the model is a DTensor (AdamW's foreach kernels and
the gradient-norm groups cannot mix them with plain tensors), while what flows between modules stays a plain local
tensor, as the split linears' styles expect."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle


def _to_replicated(module: nn.Module, inputs: tuple, mesh: Any) -> tuple:
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def _to_local(module: nn.Module, outputs: Any, mesh: Any) -> Any:
    return outputs.to_local() if isinstance(outputs, DTensor) else outputs


class Replicated(ParallelStyle):
    """The module's parameters and buffers replicated over the tp mesh; tensor inputs enter as replicated
    DTensors, outputs leave as local tensors (every tp rank computes the same values)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        # the hooks return new inputs / outputs (torch uses them), though the stub types them as returning None
        return distribute_module(module, device_mesh, None, _to_replicated, _to_local)  # type: ignore[arg-type]
