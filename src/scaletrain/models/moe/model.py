"""A DeepSeek-style mixture-of-experts decoder: the built-in Llama (models/llama/model.py: attention, RoPE, document
masks, stages) with each MLP after the first n_dense_layers replaced by a top-k routed set of fine-grained SwiGLU experts plus
shared experts.

Routing works on whole tensors: the (token, choice) pairs are sorted by expert (one argsort), gathered, run through
the experts as contiguous groups and added back with their router weights (index_add_); no Python per token.
Where the experts run is the layer's `dispatcher`: here, on this rank; expert parallelism
(parallel/expert.py) swaps in one that sends each group to the rank holding its expert with all-to-all.

Expert weights are stacked: w1/w3 (n_experts, dim, expert_dim), w2 (n_experts, expert_dim, dim); under expert
parallelism each rank holds a contiguous slice of the experts (a DTensor sharded on dim 0).
"""

from __future__ import annotations

import math
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.models.llama.model import FeedForward, Llama
from scaletrain.models.llama.model import param_init_std as llama_param_init_std
from scaletrain.models.moe.args import MoEArgs


def local_experts(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a stacked expert weight (all of them without expert parallelism)."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


def shape_only(x: torch.Tensor) -> bool:
    """True when `x` has shapes but no values (the meta device, or a fake tensor of the planner's trace): routing then
    assumes uniform load, every expert taking an equal share of the (token, choice) pairs (plan/trace.py)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return x.device.type == "meta" or isinstance(x, FakeTensor)


def expert_counts(flat: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Pairs per expert, int64 (n_experts,): bincount's values through scatter_add_, whose output shape does not
    depend on the values, so meta and fake tensors (the planner's trace) take it too."""
    return torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def split_sizes(x: torch.Tensor, counts: torch.Tensor) -> list[int]:
    """Rows of `x` per expert: `counts` read back, or under shape-only tracing an even split (the first experts one
    row more), as uniform routing would give."""
    if shape_only(x) or shape_only(counts):
        n, k = x.shape[0], counts.shape[0]
        return [n // k + (1 if e < n % k else 0) for e in range(k)]
    return [int(c) for c in counts.tolist()]


def use_grouped_mm(x: torch.Tensor) -> bool:
    """torch._grouped_mm for the experts' matmuls: CUDA with bf16 only. On CPU (torch 2.13) its forward runs for
    16-byte-aligned strides but its backward fails ("Invalid strides/sizes"), so CPU ranks loop over experts."""
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


class GroupedExperts(nn.Module):
    """n_experts SwiGLU MLPs with stacked weights; forward takes tokens sorted by expert and each expert's count."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))  # gate
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))  # down
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))  # up

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: (N, dim) grouped by (local) expert; counts: (local experts,) int64 summing to N."""
        w1, w2, w3 = local_experts(self.w1), local_experts(self.w2), local_experts(self.w3)
        if use_grouped_mm(x):
            offsets = torch.cumsum(counts, 0).to(torch.int32)
            h = F.silu(torch._grouped_mm(x, w1, offs=offsets)) * torch._grouped_mm(x, w3, offs=offsets)
            return torch._grouped_mm(h, w2, offs=offsets)
        outs = []
        for e, part in enumerate(torch.split(x, split_sizes(x, counts))):
            outs.append((F.silu(part @ w1[e]) * (part @ w3[e])) @ w2[e])
        return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[-1])


class Dispatcher(Protocol):
    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor: ...


def run_local(tokens: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
    """Every expert is on this rank: run them on the sorted tokens."""
    return experts(tokens, counts)


class _AuxLoss(torch.autograd.Function):
    """Returns `out` unchanged; its backward also feeds d(aux)/d(aux) = 1 into the router's auxiliary loss, so the
    loss need not travel to the task's loss (Megatron-Core's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape = aux.shape
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones(ctx.aux_shape, device=grad.device)


class MoEFeedForward(nn.Module):
    """Router + routed experts + shared experts of one block; counts each expert's load while training."""

    expert_bias: torch.Tensor  # buffers (register_buffer), declared for the type checker
    tokens_per_expert: torch.Tensor
    dropped_tokens: torch.Tensor

    def __init__(self, args: MoEArgs, layer_id: int, lean_activations: bool = True):
        super().__init__()
        self.args, self.layer_id = args, layer_id
        self.router = nn.Linear(args.dim, args.n_experts, bias=False)
        self.experts = GroupedExperts(args.n_experts, args.dim, args.expert_dim)
        shared_dim = args.expert_dim * args.n_shared_experts
        self.shared = (
            FeedForward(args, lean_activations, hidden_dim=shared_dim)  # type: ignore[arg-type]  # reads dim
            if args.n_shared_experts
            else None
        )
        # selection bias of the auxiliary-loss-free balancing: picks experts, never weighs them (DeepSeek-V3)
        self.register_buffer("expert_bias", torch.zeros(args.n_experts))
        # load since the last optimizer step (ModelSpec.after_optimizer_step reads and clears them)
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_experts), persistent=False)
        self.register_buffer("dropped_tokens", torch.zeros(()), persistent=False)
        self.dispatcher: Dispatcher = run_local

    def init_buffers(self) -> None:
        with torch.no_grad():
            self.expert_bias.zero_()
            self.tokens_per_expert.zero_()
            self.dropped_tokens.zero_()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x (T, dim) -> (weights (T, k) fp32, experts (T, k) int64, auxiliary loss or None)."""
        a = self.args
        logits = self.router(x).float()
        scores = logits.softmax(-1) if a.score_func == "softmax" else logits.sigmoid()
        _, chosen = torch.topk(scores + self.expert_bias, a.top_k, dim=-1)
        weights = scores.gather(-1, chosen)
        if a.route_norm and a.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        aux = None
        if self.training and a.aux_loss_coef > 0:
            load = expert_counts(chosen.flatten(), a.n_experts).float() / chosen.numel()
            probs = scores / scores.sum(-1, keepdim=True)
            aux = a.aux_loss_coef * a.n_experts * (load * probs.mean(0)).sum()
        return weights, chosen, aux

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.args
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen, aux = self.route(x)
        flat = chosen.flatten()  # (T·k,): pair i is token i // k's choice i % k
        order = torch.argsort(flat, stable=True)
        counts = expert_counts(flat, a.n_experts)
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
        # shape-only tracing routes uniformly: no expert exceeds a capacity factor >= 1, nothing is dropped
        if a.capacity_factor > 0 and not (shape_only(x) and a.capacity_factor >= 1):
            # keep each expert's first `capacity` pairs in token order
            capacity = math.ceil(a.capacity_factor * flat.numel() / a.n_experts)
            starts = torch.cumsum(counts, 0) - counts
            rank_in_expert = torch.arange(flat.numel(), device=x.device) - starts[flat[order]]
            kept = rank_in_expert < capacity
            if self.training:
                with torch.no_grad():
                    self.dropped_tokens += (~kept).sum().to(self.dropped_tokens.dtype)
            order, counts = order[kept], counts.clamp(max=capacity)
        token = order // a.top_k
        routed = self.dispatcher(x[token], counts, self.experts)
        routed = routed * weights.flatten()[order, None].to(routed.dtype)
        out = torch.zeros_like(x).index_add_(0, token, routed.to(x.dtype))
        if self.shared is not None:
            out = out + self.shared(x)
        if aux is not None:
            out = _AuxLoss.apply(out, aux)
        return out.view(shape)


class MoETransformer(Llama):
    """The built-in Llama with MoEFeedForward as the MLP of blocks n_dense_layers.. (the first ones keep the dense
    SwiGLU of ffn_dim): parameter names, forward, RoPE, document masks, stages and CP are Llama's."""

    def __init__(self, args: MoEArgs, lean_activations: bool = True):
        super().__init__(args, lean_activations)  # type: ignore[arg-type]  # MoEArgs has every field Llama reads

    def feed_forward(self, layer_id: int, lean_activations: bool) -> nn.Module:
        args = cast(MoEArgs, self.args)
        if args.is_moe_layer(layer_id):
            return MoEFeedForward(args, layer_id, lean_activations)
        return FeedForward(self.args, lean_activations)


def param_init_std(name: str, args: MoEArgs) -> float | None:
    """Initial std of a parameter by its name; None: ones (norm weights). Llama's, with the stacked experts' down
    projection scaled by depth as every residual projection is."""
    if name.endswith("experts.w2"):
        return 0.02 / math.sqrt(2 * args.n_layers)
    return llama_param_init_std(name, args)  # type: ignore[arg-type]  # reads dim and n_layers
