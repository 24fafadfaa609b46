"""Context parallelism: every sequence of a micro-batch is split over the `cp` ranks of the mesh, so activations
per rank fall as 1/cp and sequences far longer than one device holds can train.

Load balancing for causal attention: the sequence is cut into 2·cp chunks and cp rank r keeps chunks r and
2·cp-1-r (a head and a tail chunk), so every rank attends over the same number of (query, key) pairs — the layout
torch's own context_parallel uses (its _HeadTailLoadBalancer), which lets both methods below share the sharding.
Rotary embeddings are taken at each token's global position (ModelSpec.context_parallel), and the loss of each
rank's tokens adds up to the sequence's: the trainer sums the token loss over all ranks once, and the gradient
reduction averages over dp x cp ranks (Layout.grad_average) with the FSDP shard group spanning dp_shard x cp.

Two ways to attend, picked by parallel.cp_method:
- allgather (any device, gloo included; the Llama 3 paper's method, section 3.3.2): each rank all-gathers the keys
  and values of the whole sequence over the cp group (one collective per block; autograd's backward is a
  reduce-scatter of their gradients) and attends with its own queries under a causal mask built from global
  positions. Its traffic is K and V only, small for grouped-query attention (n_kv_heads << n_heads).
- ring (CUDA only): torch's context-parallel SDPA (torch.distributed.tensor.experimental; ring attention over
  flash / memory-efficient / cuDNN kernels, K/V rotated by all-gather or all-to-all). torch has no CPU kernel for it.
auto: ring on CUDA for models whose K and V are as large as Q (n_kv_heads == n_heads), otherwise allgather.

Document masking: data.mask_doc_starts drops the loss on document starts through the targets, which are sharded
with the inputs, so it holds under cp. Attention stays causal over the packed sequence, as without cp (no
per-document attention mask). Rows packing several documents (data.packing=document) are sharded the same way
(head and tail chunk of the row): the allgather method also gathers the keys' document ids and attends within each
document, each rank still computing its s x S scores (equal work); ring attention refuses them before launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.models.document_attention import DocumentMask
from scaletrain.models.spec import ModelSpec

CP_METHODS = ("auto", "allgather", "ring")


def cp_positions(seq_len: int, cp: int, cp_rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Global positions (int64, length seq_len/cp) of the tokens cp rank `cp_rank` holds: chunk r and chunk
    2·cp-1-r of 2·cp equal chunks."""
    if seq_len % (2 * cp):
        raise ValueError(f"data.seq_len: {seq_len} is not divisible by 2 x parallel.cp = {2 * cp}")
    chunk = seq_len // (2 * cp)
    head = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    tail_start = (2 * cp - 1 - cp_rank) * chunk
    return torch.cat([head, torch.arange(tail_start, tail_start + chunk, device=device)])


def pick_cp_method(method: str, device_type: str, spec: ModelSpec) -> str:
    """'allgather' or 'ring' for parallel.cp_method on this device type; ValueError (one line) when the choice
    cannot run here."""
    if method not in CP_METHODS:
        raise ValueError(f"parallel.cp_method: {method!r} is not one of {', '.join(CP_METHODS)}")
    if method == "ring" and device_type != "cuda":
        raise ValueError(
            "parallel.cp_method: ring runs torch's context-parallel SDPA, which has no CPU kernel; "
            "use parallel.cp_method=allgather (or auto) on CPU ranks"
        )
    if method != "auto":
        return method
    shape = spec.shape()
    gqa = shape is not None and shape.n_kv_heads < shape.n_heads
    return "ring" if device_type == "cuda" and not gqa else "allgather"


class AllGatherKVAttention(nn.Module):
    """Causal attention of this rank's queries over the keys and values of the whole sequence, all-gathered over
    the cp group. q: (B, H, s, D), k/v: (B, H_kv, s, D) with s = S/cp local tokens; returns (B, H, s, D).

    The gathered keys come in rank order (each rank's head and tail chunk), not in sequence order; softmax does
    not care about the order of keys, and the mask compares global positions, so no reordering is needed.
    The mask (s x S) is additive in the compute dtype (SDPA would convert a boolean one to that, once per block),
    built once per dtype and shared by every block."""

    def __init__(self, group, allowed: torch.Tensor, masks: dict):
        super().__init__()
        self.group = group
        # plain attributes, not buffers: never checkpointed, never touched by to_empty()
        self.allowed = allowed  # (s, S) bool: query position >= key position
        self.masks = masks  # {dtype: additive mask}, shared by the blocks of this rank

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self.masks:
            zero = torch.zeros(self.allowed.shape, dtype=dtype, device=self.allowed.device)
            self.masks[dtype] = zero.masked_fill(~self.allowed, float("-inf"))
        return self.masks[dtype]

    def document_mask(self, mask: DocumentMask, dtype: torch.dtype) -> torch.Tensor:
        """Additive (B, 1, s, S) mask of packed rows: causal by global position and within each document; the
        keys' document ids are gathered over the cp group once per forward (kept on `mask` for every block)."""

        def allowed() -> torch.Tensor:
            from torch.distributed._functional_collectives import all_gather_tensor

            local = mask.documents  # (B, s): this rank's tokens
            keys = all_gather_tensor(local.t().contiguous(), 0, self.group).t()  # (B, S) in rank order, as k/v
            return self.allowed[None, None] & (local[:, None, :, None] == keys[:, None, None, :])

        def additive() -> torch.Tensor:
            ok = mask.cached(("cp_allowed", id(self.masks)), allowed)  # one gather for all blocks
            return torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill(~ok, float("-inf"))

        return mask.cached(("cp_additive", id(self.masks), dtype), additive)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask | None = None
    ) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_gather_single_autograd

        # one collective for K and V together; its backward reduce-scatters (sums) their gradients
        kv = torch.stack((k, v)).transpose(0, 3).contiguous()  # (s, B, H_kv, 2, D): gather along dim 0
        kv = all_gather_single_autograd(kv, 0, self.group)
        k, v = kv.transpose(0, 3).unbind(0)
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        attn_mask = self.mask(q.dtype) if mask is None else self.document_mask(mask, q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)


class _CausalSDPA(nn.Module):
    """SDPA with is_causal=True as its own module, so torch's _ContextParallel style can wrap it (ring method)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class RingAttention(nn.Module):
    """torch's context-parallel SDPA (CUDA): q, k, v of the local chunks in the head-tail layout; K and V are
    rotated between the cp ranks inside torch's ring attention. k/v heads are repeated for GQA first."""

    def __init__(self, cp_mesh):
        super().__init__()
        # private torch API (torch 2.13): the module-wrapper form torchtitan uses; the public context_parallel()
        # context manager also shards buffers in place, which our loader-side sharding already does
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _ContextParallel,
            _cp_options,
            _enable_context_parallel_dispatcher,
        )

        _cp_options.enable_load_balance = True  # our head-tail layout is torch's load-balanced one
        _enable_context_parallel_dispatcher()
        self.sdpa = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA)._apply(
            _CausalSDPA(), cp_mesh
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        return self.sdpa(q, k, v)


@dataclass
class ContextParallel:
    """This rank's part of every sequence, and how its attention reaches the rest."""

    positions: torch.Tensor  # (S/cp,) int64 global positions of the local tokens, on the compute device
    cp: int
    method: str  # "allgather" or "ring"

    def shard(self, tokens: torch.Tensor) -> torch.Tensor:
        """The local tokens of (B, S) inputs or targets: (B, S/cp), in the order of `positions`."""
        return tokens.index_select(1, self.positions.to(tokens.device))

    def describe(self) -> str:
        n = self.positions.numel()
        return f"context parallel {self.cp}: {n} tokens per rank (head + tail chunk), {self.method} attention"


def apply_context_parallel(
    model: nn.Module, spec: ModelSpec, cp_mesh, device: torch.device, method: str, seq_len: int
) -> ContextParallel:
    """Make `model` (or a pipeline stage of it) run on this cp rank's part of seq_len-token sequences: attention
    by `method` ('allgather' or 'ring', from pick_cp_method), RoPE at global positions. Call before tensor
    parallelism and FSDP (the cores hold no parameters)."""
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    positions = cp_positions(seq_len, cp, rank, device)
    if method == "ring":
        spec.context_parallel(model, lambda _old: RingAttention(cp_mesh), positions)
    else:
        keys = torch.cat([cp_positions(seq_len, cp, r, device) for r in range(cp)])
        allowed = positions[:, None] >= keys[None, :]
        group = cp_mesh.get_group()
        masks: dict[torch.dtype, torch.Tensor] = {}
        spec.context_parallel(model, lambda _old: AllGatherKVAttention(group, allowed, masks), positions)
    return ContextParallel(positions, cp, method)
