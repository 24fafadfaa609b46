"""Expert parallelism for transformers' mixture-of-experts layers (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, ...).

transformers (5.x) keeps a layer's routed experts in one module of packed weights: `gate_up_proj` (experts,
2·inter, hidden), gate rows first, and `down_proj` (experts, hidden, inter), called as
`experts(hidden_states (T, hidden), top_k_index (T, k), top_k_weights (T, k))` by its MoE block, which routes (and
adds shared experts) itself. Under expert parallelism (parallel/expert.py) the packed weights become DTensors sharded
on the expert dim and this module's forward is replaced, on the instance, by `expert_parallel_forward`: the (token,
choice) rows sorted by expert go through the layer's all-to-all dispatcher to the rank holding their expert, run
there through its experts as contiguous groups, come back, and are summed per token with the router's weights,
as transformers' own forward does. The router, the shared experts and the block's code stay transformers'.

While training, a forward pre-hook on each such module counts the (token, expert) pairs its router gave it
(`count_load`); after each optimizer step `take_load` sums them over the ranks into the expert-load metrics the
built-in family logs (moe_imbalance, moe_busiest_expert, ...; models/moe/balance.py load_metrics).

Layouts transformers marks otherwise (gpt-oss: interleaved gate/up, transposed, biased; experts without a gate; a
norm after each expert) are not split: `splittable` tells them apart, and parallel.ep is refused for them.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.models.moe.model import expert_counts, local_experts, shape_only, split_sizes


def splittable(experts: object) -> bool:
    """Whether `experts` is a transformers packed-experts module in the layout expert_parallel_forward runs:
    concatenated [gate; up] rows, (experts, out, in) weights, a gate, no biases, no norm after each expert."""
    if not isinstance(experts, nn.Module):
        return False
    packed = all(
        isinstance(getattr(experts, name, None), nn.Parameter) and getattr(experts, name).dim() == 3
        for name in ("gate_up_proj", "down_proj")
    )
    flags = {"is_concatenated": True, "is_transposed": False, "has_gate": True, "has_bias": False}
    return (
        packed
        and isinstance(getattr(experts, "num_experts", None), int)
        and all(getattr(experts, flag, not want) is want for flag, want in flags.items())
        and not getattr(experts, "has_post_expert_norm", False)  # a flag of later 5.x releases
    )


def use_dispatcher(experts: nn.Module, dispatcher: Any) -> None:
    """Route `experts`' rows through `dispatcher` from now on (an instance attribute: the class, and every other
    model built from it, keep transformers' forward)."""
    experts.dispatcher = dispatcher
    experts.forward = partial(expert_parallel_forward, experts)


def expert_parallel_forward(
    experts: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts forward, its rows dispatched: (T, hidden) tokens, their k experts and router weights
    -> (T, hidden), the weighted sum of each token's experts."""
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # rows by expert, each expert's in token order
    token = order // k
    routed = experts.dispatcher(hidden_states[token], expert_counts(flat, experts.num_experts), partial(_run, experts))
    routed = routed * top_k_weights.reshape(-1)[order, None].to(routed.dtype)
    return torch.zeros_like(hidden_states).index_add_(0, token, routed.to(hidden_states.dtype))


def _run(experts: Any, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """This rank's experts on `x`, rows grouped by (local) expert, `counts` rows each."""
    gate_up, down = local_experts(experts.gate_up_proj), local_experts(experts.down_proj)
    outs = [
        F.linear(experts._apply_gate(F.linear(part, gate_up[e])), down[e])
        for e, part in enumerate(torch.split(x, split_sizes(x, counts)))
    ]
    return torch.cat(outs) if outs else x.new_zeros(0, down.shape[1])


def count_load(experts: nn.Module) -> None:
    """Count, while training, the (token, expert) pairs each of `experts` is given (transformers' top_k_index)."""
    experts.register_forward_pre_hook(_count, with_kwargs=True)


def _count(module: Any, args: tuple, kwargs: dict) -> None:
    if not module.training:
        return
    index = args[1] if len(args) > 1 else kwargs["top_k_index"]
    if shape_only(index):
        return
    with torch.no_grad():
        counts = expert_counts(index.reshape(-1), module.num_experts)
        load = getattr(module, "_scaletrain_load", None)
        module._scaletrain_load = counts if load is None else load + counts


@torch.no_grad()
def take_load(spec: Any, modules: list[nn.Module]) -> dict[str, float]:
    """Read and clear the pairs counted since the last call in this rank's MoE layers (of `modules`: the model or
    its pipeline stages, layers keyed by their index in the whole model), sum them over every rank (one
    all-reduce; every rank calls this) and return the step's load metrics ({} when nothing was routed)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from scaletrain.models.moe.balance import load_metrics

    n_experts = int(spec.n_experts)
    device = next(p.device for part in modules for p in part.parameters())
    load = torch.zeros(spec.n_blocks, n_experts + 2, dtype=torch.float64, device=device)
    for part in modules:
        part = getattr(part, "module", part) if isinstance(part, DistributedDataParallel) else part
        container = spec.blocks(part)
        for key, block in container.items() if hasattr(container, "items") else enumerate(container):
            for m in block.modules():
                counts = getattr(m, "_scaletrain_load", None)
                if counts is not None:
                    load[int(key), :n_experts] += counts.to(device=device, dtype=torch.float64)
                    m._scaletrain_load = None
                if hasattr(m, "dispatcher") and hasattr(m.dispatcher, "take_bytes_sent"):
                    load[int(key), n_experts + 1] += float(m.dispatcher.take_bytes_sent())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(load)
    return load_metrics(load)
