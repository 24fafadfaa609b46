"""The per-step mechanics every loop needs, whatever the layout: autocast, accumulation without gradient sync,
loss scaling, global-norm clipping and the optimizer step. The built-in trainer and `scaletrain.setup()` share it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from scaletrain.config.layout import DataParallelMode, Layout
from scaletrain.config.precisions import precision
from scaletrain.parallel.data_parallel import DTYPES, uses_autocast
from scaletrain.parallel.apply import ParallelModel
from scaletrain.parallel.context_parallel import ContextParallel
from scaletrain.parallel.dims import dp_coordinates
from scaletrain.parallel.pipeline import Pipeline
from scaletrain.parallel.runtime import Runtime


def rebind_optimizer(
    optimizer: torch.optim.Optimizer, old_names: dict[int, str], model: nn.Module
) -> torch.optim.Optimizer:
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


def _grad_groups(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Parameters with gradients, grouped so that each group's tensors combine in one foreach kernel: plain
    tensors together, DTensors by (mesh, placements) (TP leaves some params plain and shards others)."""
    groups: dict = {}
    for p in params:
        if p.grad is None:
            continue
        g: Any = p.grad  # a plain tensor or a DTensor
        key = (id(g.device_mesh), tuple(g.placements)) if hasattr(g, "device_mesh") else None
        groups.setdefault(key, []).append(p)
    return list(groups.values())


def global_grad_norm(
    params: list[nn.Parameter], pp_group=None, rank_local: list[nn.Parameter] | None = None
) -> torch.Tensor:
    """L2 norm of all gradients across every rank and shard: DTensor grads reduce over their mesh (FSDP, TP),
    and with pipeline parallelism the stages' squared norms add up over pp_group. `rank_local`: plain weights only
    one rank holds (table-wise sharded embedding tables, parallel/embedding.py), their squared norms summed over
    every rank; None when the model has none anywhere (given, even empty, every rank joins that all-reduce)."""
    total = torch.zeros((), dtype=torch.float32)
    if rank_local is not None:
        local = [p.grad for p in rank_local if p.grad is not None]
        total = torch.nn.utils.get_total_norm(local, norm_type=2.0, foreach=True).float() ** 2 if local else total
        torch.distributed.all_reduce(total)
    for group in _grad_groups(params):
        grads: list[Any] = [p.grad for p in group]  # plain tensors or DTensors (placements, device_mesh)
        placements = getattr(grads[0], "placements", ())
        if any(pl.is_partial() for pl in placements):
            norm = cast(Any, torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)).full_tensor()
            squared = norm.float() ** 2
        else:
            # squared norms of the local shards add up over every mesh dim that shards them (not over replicas);
            # one all-reduce per dim, where DTensor's own redistribute warns about doing the same
            local = [g.to_local() if placements else g for g in grads]
            squared = torch.nn.utils.get_total_norm(local, norm_type=2.0, foreach=True).float() ** 2
            for dim, pl in enumerate(placements):
                if not pl.is_replicate():  # Shard, or FSDP's _StridedShard over a TP shard
                    torch.distributed.all_reduce(squared, group=grads[0].device_mesh.get_group(dim))
        total = total.to(squared.device) + squared
    if pp_group is not None:
        torch.distributed.all_reduce(total, group=pp_group)
    return total.sqrt()


def clip_grads_(params: list[nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale every gradient by min(1, max_norm / total_norm), one foreach kernel per group."""
    for group in _grad_groups(params):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm, foreach=True)


@dataclass(kw_only=True)
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
    layout: Layout
    mesh: Any  # DeviceMesh with named dims (parallel/dims.py)
    device: torch.device
    rank: int
    world_size: int
    dp_rank: int
    dtype: str = "fp32"
    grad_clip: float = 0.0
    scaler: torch.amp.GradScaler | None = None  # fp16 only (ShardedGradScaler under FSDP)
    pipeline: Pipeline | None = None  # the schedule running this rank's stages (pp > 1)
    loss_parallel: bool = False  # logits are vocabulary-sharded: loss and backward under loss_parallel()
    context: ContextParallel | None = None  # cp > 1: each rank feeds its part of every sequence (shard_sequence)
    # FSDP/HSDP accumulation: "sharded" reduce-scatters every micro-batch into the sharded gradient (memory / N),
    # "unsharded" keeps whole fp32 gradients until the last one (one reduce-scatter per step)
    fsdp_accumulate: str = "sharded"
    # what derives from the weights and must follow them (fp8: the float8 all-gather's precomputed scales)
    after_weights_change: Callable[[], None] | None = None
    # metrics of the last optimizer step from the model's own step hook (an MoE model's expert load)
    step_metrics: dict[str, float] = field(default_factory=dict)
    _params: list = field(default_factory=list, repr=False)

    @classmethod
    def for_model(
        cls, model: ParallelModel, optimizer: torch.optim.Optimizer, rt: Runtime, grad_clip: float = 0.0
    ) -> Job:
        """The Job of a model apply_parallelism laid out: this rank's data-parallel coordinate, the loss scaler its
        precision needs (the plan's [precision] section), how its step runs (pipeline, loss parallel) and how FSDP
        accumulates (parallel.fsdp_accumulate) come from the model's plan and mesh. grad_clip: max global L2 norm
        of the gradients (0: no clipping)."""
        plan = model.plan
        dp_rank, _ = dp_coordinates(plan.layout, model.mesh)
        hook = model.after_optimizer_step
        if hook is not None:  # torch's own optimizer hook: runs after every step that updates the weights
            optimizer.register_step_post_hook(lambda optimizer, args, kwargs: hook())
        return cls(
            after_weights_change=hook,
            step_metrics=model.step_metrics,
            model=model.module,
            optimizer=optimizer,
            layout=plan.layout,
            mesh=model.mesh,
            device=rt.device,
            rank=rt.rank,
            world_size=rt.world_size,
            dp_rank=dp_rank,
            dtype=plan.precision.dtype,
            grad_clip=grad_clip,
            scaler=make_scaler(
                plan.layout,
                plan.precision.dtype,
                rt.device,
                plan.precision.loss_scale_init,
                plan.precision.loss_scale_growth_interval,
            ),
            pipeline=model.pipeline,
            loss_parallel=model.loss_parallel,
            context=model.context,
            fsdp_accumulate=plan.parallel.fsdp_accumulate,
        )

    def __post_init__(self) -> None:
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        from scaletrain.parallel.embedding import rank_local_params, sharded_tables

        table_wise = any(tables.how == "table" for tables in sharded_tables(self.model))
        self._rank_local: list[nn.Parameter] | None = rank_local_params(self.model) if table_wise else None
        self._pp_group = self.mesh["pp"].get_group() if self.layout.pp > 1 else None
        # one rank per data-parallel coordinate reports the loss: the last pipeline stage's first TP rank
        tp_rank = self.mesh["tp"].get_local_rank() if self.layout.tp > 1 else 0
        self.owns_loss = tp_rank == 0 and (self.pipeline is None or self.pipeline.has_last)

    def shard_sequence(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's part of (B, S) inputs or targets: all of it, or under context parallelism its S/cp tokens."""
        return tokens if self.context is None else self.context.shard(tokens)

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    def autocast(self):
        """Context for the forward pass: autocast to the compute dtype where FSDP does not cast itself."""
        if uses_autocast(self.layout, self.dtype):
            return torch.autocast(self.device.type, dtype=DTYPES[self.dtype])
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def accumulate(self, sync: bool = True):
        """Forward + backward inside this context reduce gradients across ranks only when sync is True, except
        under FSDP/HSDP with fsdp_accumulate="sharded", which reduce-scatters every micro-batch into the sharded
        gradient. Under pipeline parallelism the schedule itself holds the reduction until the last micro-batch."""
        if self.layout.pp > 1:
            yield
            return
        model = cast(Any, self.model)  # DistributedDataParallel or an FSDPModule, by layout.mode
        if self.layout.mode is DataParallelMode.DDP and not sync:
            with model.no_sync():
                yield
            return
        if self.layout.mode.sharded:
            model.set_requires_gradient_sync(sync or self.fsdp_accumulate == "sharded")
        yield

    def weights_loaded(self) -> None:
        """Tell the job its weights were replaced outside a step (checkpoint restore, weight import): what derives
        from them is recomputed. (Restoring an optimizer runs a zero-lr step on the old weights first.)"""
        if self.after_weights_change is not None:
            self.after_weights_change()

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def step(self, skip_nonfinite: bool = False) -> torch.Tensor:
        """Unscale, clip to the global norm (when grad_clip > 0), step, zero grads; returns the pre-clip norm.

        skip_nonfinite: when the global norm is NaN/Inf, drop this step's update (every rank sees the same norm,
        so all skip together). With fp16 the loss scaler already skips such steps and lowers the scale.
        """
        shared = self.pipeline.shared if self.pipeline is not None else None
        if shared is not None:  # tied copies on two stages: each gets their summed gradient, counted once
            shared.reduce_grads()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        uncounted = (shared.uncounted if shared is not None else set()) | {id(p) for p in self._rank_local or ()}
        counted = [p for p in self._params if id(p) not in uncounted] if uncounted else self._params
        norm = global_grad_norm(counted, self._pp_group, self._rank_local)
        if skip_nonfinite and self.scaler is None and not torch.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            return norm
        if self.grad_clip > 0:
            clip_grads_(self._params, self.grad_clip, norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm


def make_scaler(layout: Layout, dtype: str, device: torch.device, init_scale: float, growth_interval: int):
    """fp16 needs loss scaling: GradScaler, or ShardedGradScaler when gradients are sharded by FSDP."""
    if not precision(dtype).loss_scaling:
        return None
    if layout.mode.sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device.type, init_scale=init_scale, growth_interval=growth_interval)
    return torch.amp.GradScaler(device.type, init_scale=init_scale, growth_interval=growth_interval)
