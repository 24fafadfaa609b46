"""The per-step mechanics every loop needs, whatever the layout: autocast, accumulation without gradient sync,
loss scaling, global-norm clipping and the optimizer step. The built-in trainer and `scaletrain.setup()` share it.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from scaletrain.parallel.data_parallel import DTYPES, uses_autocast
from scaletrain.parallel.dims import ParallelDims


def rebind_optimizer(optimizer: torch.optim.Optimizer, old_names: dict[int, str],
                     model: nn.Module) -> torch.optim.Optimizer:
    """A fresh optimizer of the same class and hyper-parameters over the model's current parameters.

    FSDP2 replaces each parameter with a sharded one, so an optimizer built before sharding points at tensors the
    model no longer uses; parameters are matched by name.
    """
    current = {}
    for name, p in model.named_parameters():
        current[name.removeprefix("module.")] = p
    groups = []
    for group in optimizer.param_groups:
        params = [current[old_names[id(p)]] for p in group["params"]]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    accepted = inspect.signature(type(optimizer).__init__).parameters
    # groups carry every hyper-parameter; defaults only for keys the constructor takes (AdamW stores extra ones)
    return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})


def global_grad_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """L2 norm of all gradients across every rank and shard (DTensor grads reduce over their mesh)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm


@dataclass
class Job:
    """A model and optimizer prepared for a layout. Use in a loop as:

        for micro, is_last in ...:
            with job.accumulate(sync=is_last), job.autocast():
                loss = ...
            job.backward(loss)
        grad_norm = job.step()
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    dims: ParallelDims
    mesh: object
    device: torch.device
    rank: int
    world_size: int
    dp_rank: int
    dtype: str = "fp32"
    grad_clip: float = 0.0
    scaler: object | None = None
    _params: list = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._params = [p for p in self.model.parameters() if p.requires_grad]

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    def autocast(self):
        """Context for the forward pass: autocast to the compute dtype where FSDP does not cast itself."""
        if uses_autocast(self.dims, self.dtype):
            return torch.autocast(self.device.type, dtype=DTYPES[self.dtype])
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def accumulate(self, sync: bool = True):
        """Forward + backward inside this context reduce gradients across ranks only when sync is True."""
        if self.dims.mode == "ddp" and not sync:
            with self.model.no_sync():
                yield
            return
        if self.dims.mode in ("fsdp", "hsdp"):
            self.model.set_requires_gradient_sync(sync)
        yield

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def step(self) -> torch.Tensor:
        """Unscale, clip to the global norm (when grad_clip > 0), step, zero grads; returns the pre-clip norm."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm = global_grad_norm(self._params)
        if self.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(self._params, self.grad_clip, norm, foreach=True)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm


def make_scaler(dims: ParallelDims, dtype: str, device: torch.device, init_scale: float, growth_interval: int):
    """fp16 needs loss scaling: GradScaler, or ShardedGradScaler when gradients are sharded by FSDP."""
    if dtype != "fp16":
        return None
    if dims.mode in ("fsdp", "hsdp"):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device.type, init_scale=init_scale, growth_interval=growth_interval)
    return torch.amp.GradScaler(device.type, init_scale=init_scale, growth_interval=growth_interval)
