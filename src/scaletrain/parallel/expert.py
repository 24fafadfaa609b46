"""Expert parallelism: the routed experts of a mixture-of-experts model split over the `ep` ranks of the mesh
(carved from dp_shard: parallel/dims.py), each rank holding n_experts / ep of them (a DTensor sharded on the expert
dim), and every MoE layer's tokens sent to the rank holding their expert with `all_to_all_single` (uneven splits:
dropless, each rank sends what its router chose) and brought back the same way.

The experts' weights are then sharded by FSDP2 over the dp_shard / ep ranks that hold the same experts
(`shard_experts`), before the blocks are sharded over all dp_shard ranks. An expert's gradient already sums the
tokens of its ep ranks (the all-to-all's backward), so its reduction divides by the whole data-parallel degree, not
by the ranks it reduces over: every parameter then gets the gradient of the same mean loss as one process.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.models.spec import ModelSpec


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; backward sends the gradients back along the reverse splits."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class AllToAllDispatcher:
    """An MoE layer's dispatcher under expert parallelism: tokens sorted by expert go to the rank holding it,
    run grouped by local expert, and come back in the order they left. Counts the rows it sends (tokens_sent,
    to other ranks and to itself) for tests and the benchmark's byte count."""

    def __init__(self, group, n_experts: int):
        self.group = group
        self.ep = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.local_experts = n_experts // self.ep
        self.tokens_sent = 0  # (token, expert) rows this rank sent, itself included
        self.bytes_sent = 0  # bytes of hidden states sent to other ranks (dispatch and combine, forward only)

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        ep, n_local = self.ep, self.local_experts
        # how many rows each rank sends each of this rank's experts: (ep sources, n_local) after the exchange
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        send = counts.view(ep, n_local).sum(1).tolist()
        from_each = received.view(ep, n_local)
        recv = from_each.sum(1).tolist()
        arrived = _AllToAll.apply(tokens, recv, send, self.group)
        # rows arrive by (source, expert); the experts take them by (expert, source): one stable sort of segment ids
        segment = torch.repeat_interleave(torch.arange(ep * n_local, device=tokens.device), received)
        by_expert = torch.argsort((segment % n_local) * ep + segment // n_local, stable=True)
        done = experts(arrived[by_expert], from_each.sum(0))
        back = torch.empty_like(done).index_copy(0, by_expert, done)
        row_bytes = tokens.shape[-1] * tokens.element_size()
        self.tokens_sent += sum(send)
        self.bytes_sent += (sum(send) - send[self.rank] + sum(recv) - recv[self.rank]) * row_bytes
        return _AllToAll.apply(back, send, recv, self.group)

    def take_bytes_sent(self) -> int:
        """Bytes sent to other ranks since the last call (models/moe/balance.py reads it after each step)."""
        sent, self.bytes_sent = self.bytes_sent, 0
        return sent


def apply_expert_parallel(model: nn.Module, spec: ModelSpec, ep_mesh) -> None:
    """Split every MoE layer's experts of `model` (on meta, or a pipeline stage of it) over `ep_mesh` (1-D): the
    stacked weights become DTensors sharded on the expert dim, and the layer dispatches by all-to-all."""
    from torch.distributed.tensor import Shard, distribute_tensor

    n_experts = spec.n_experts
    if n_experts is None or not spec.splits_experts:
        raise ValueError(f"parallel.ep: the {spec.family} family has no experts it splits; use parallel.ep=1")
    for layer in spec.expert_modules(model):
        experts = cast(Any, layer).experts  # the spec's MoE layers hold `experts` (ModelSpec.expert_modules)
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        spec.use_dispatcher(layer, AllToAllDispatcher(ep_mesh.get_group(), n_experts))


def shard_experts(layers: list[nn.Module], expert_mesh, divide_by: int, **fsdp_kwargs) -> None:
    """FSDP2 over each MoE layer's `experts` on `expert_mesh` (the ranks holding the same experts), reducing their
    gradients divided by `divide_by` (the data-parallel ranks every other parameter averages over)."""
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        unit = fully_shard(cast(Any, layer).experts, mesh=expert_mesh, **fsdp_kwargs)
        unit.set_gradient_divide_factor(float(divide_by))
        # a divide factor reduces by NCCL's PREMUL_SUM, which gloo lacks: sum, then divide. Not when the shard dim
        # is one rank: torch 2.13 then divides the copied gradient by the factor and again after (_fsdp_collectives)
        if expert_mesh.device_type != "cuda" and expert_mesh.size(expert_mesh.ndim - 1) > 1:  # the shard dim
            unit.set_force_sum_reduction_for_comms(True)


def dispatchers(modules: list[nn.Module]) -> list[AllToAllDispatcher]:
    """The all-to-all dispatchers of the MoE layers in `modules`, model order."""
    found = (getattr(m, "dispatcher", None) for part in modules for m in part.modules())
    return [d for d in found if isinstance(d, AllToAllDispatcher)]
