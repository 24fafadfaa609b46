"""A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query attention through
`scaled_dot_product_attention`.

Layers live in a ModuleDict keyed "0".."L-1" so parameter names stay the same when a pipeline stage keeps only
some of them; `tok_embeddings`, `norm` and `output` may be None on stages that do not own them.

lean_activations (default on) keeps less for backward at the same results: attention takes the unrepeated
grouped-query k/v (SDPA's enable_gqa) instead of keeping repeated copies, and SwiGLU recomputes its SiLU in
backward instead of keeping the SiLU output (plan/memory.py counts both ways; tests measure them).

Packed rows (data.packing = "document") come with each token's position inside its document and its document's
index in the row: rotary embeddings are taken at those positions and attention is block-causal, never crossing a
document (models/document_attention.py), so a packed row computes what its documents would one per row.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.models.document_attention import DocumentMask, document_attention, document_mask
from scaletrain.models.llama.args import LlamaArgs


def precompute_rope(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    t = torch.arange(max_seq_len, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # (S, head_dim/2)
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, S, H, D); rotates pairs (x[2i], x[2i+1]) as in the original Llama code. cos/sin: (S, D/2) tables,
    or (B, S, D/2) taken at every token's own position (packed documents)."""
    x2 = x.float().unflatten(-1, (-1, 2))
    a, b = x2[..., 0], x2[..., 1]
    cos = cos[:, :, None, :] if cos.dim() == 3 else cos[None, :, None, :]
    sin = sin[:, :, None, :] if sin.dim() == 3 else sin[None, :, None, :]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return out.type_as(x)


def _sdpa_takes_gqa(q: torch.Tensor) -> bool:
    """Whether SDPA runs grouped-query attention on unrepeated k/v in a fused kernel: the CPU flash kernel, and
    CUDA flash attention (16-bit). CUDA fp32 goes to the memory-efficient kernel, which does not take enable_gqa
    and would fall back to the math path (the s x s scores kept): repeat k/v there."""
    return q.device.type == "cpu" or q.dtype in (torch.float16, torch.bfloat16)


class CausalAttention(nn.Module):
    """softmax(q·kᵀ/√d)·v with a causal mask over (B, H, S, D); k and v may have fewer (KV) heads: passed to SDPA
    unrepeated (enable_gqa) where its kernel takes them and `lean` is on, else repeated here. Context parallelism
    swaps this module for one that sees the whole sequence's keys (parallel/context_parallel.py)."""

    def __init__(self, lean: bool = True):
        super().__init__()
        self.lean = lean

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask | None = None
    ) -> torch.Tensor:
        rep = q.shape[1] // k.shape[1]
        if mask is not None:  # packed documents: block-causal
            return document_attention(q, k, v, mask, self.lean and _sdpa_takes_gqa(q))
        if rep > 1 and self.lean and _sdpa_takes_gqa(q):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up that saves only gate and up: SiLU (one pointwise op) is recomputed in backward instead of
    its output being kept, ffn_dim elements per token less. Gradients are computed in fp32, as SiLU's own kernel."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        g = gate.float()
        sig = torch.sigmoid(g)
        silu = (g * sig).to(gate.dtype)
        d_gate = (grad * up).float() * (sig * (1 + g * (1 - sig)))
        return d_gate.to(gate.dtype), grad * silu


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs, lean_activations: bool = True):
        super().__init__()
        self.lean_activations = lean_activations
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.core: nn.Module = CausalAttention(lean_activations)  # no parameters: names and checkpoints are unchanged

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: DocumentMask | None = None
    ) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # the rotary tables come whole: under sequence parallelism the block's input is a sequence shard, and
        # only here (after the all-gather) is the full length known; per-token tables (B, S, D/2) are already
        if cos.dim() == 2:
            cos, sin = cos[:seq], sin[:seq]
        # -1 for the head count lets tensor parallelism hand this module a shard of the heads
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self.core(q, k, v) if mask is None else self.core(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP of hidden size `hidden_dim` (default: args.ffn_dim)."""

    def __init__(self, args: LlamaArgs, lean_activations: bool = True, hidden_dim: int | None = None):
        super().__init__()
        self.lean_activations = lean_activations
        hidden = args.ffn_dim if hidden_dim is None else hidden_dim
        self.w1 = nn.Linear(args.dim, hidden, bias=False)  # gate
        self.w2 = nn.Linear(hidden, args.dim, bias=False)  # down
        self.w3 = nn.Linear(args.dim, hidden, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lean_activations:
            return self.w2(_SwiGLU.apply(self.w1(x), self.w3(x)))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: LlamaArgs, lean_activations: bool = True, feed_forward: nn.Module | None = None):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args, lean_activations)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args, lean_activations) if feed_forward is None else feed_forward

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: DocumentMask | None = None
    ) -> torch.Tensor:
        # the mask goes by keyword: sequence parallelism's input hooks lay out the positional inputs only
        h = x + self.attention(self.attention_norm(x), cos, sin, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """The decoder. A family that changes only the blocks' MLP (models/moe/: routed experts) subclasses it and
    overrides `feed_forward`; everything else (embeddings, RoPE, document masks, stages, CP) stays this code."""

    rope_cos: torch.Tensor  # buffers (register_buffer), declared for the type checker
    rope_sin: torch.Tensor

    def __init__(self, args: LlamaArgs, lean_activations: bool = True):
        super().__init__()
        args.check()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {
                str(i): TransformerBlock(args, lean_activations, self.feed_forward(i, lean_activations))
                for i in range(args.n_layers)
            }
        )
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # global position of each local token when context parallelism hands this rank a part of the sequence
        self.positions: torch.Tensor | None = None

    def feed_forward(self, layer_id: int, lean_activations: bool) -> nn.Module:
        """The MLP of block `layer_id`, (B, S, dim) -> (B, S, dim): a SwiGLU of args.ffn_dim here."""
        return FeedForward(self.args, lean_activations)

    def init_buffers(self) -> None:
        """Recompute the rotary tables, e.g. after `to_empty()` on a model built on the meta device."""
        cos, sin = precompute_rope(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens (B, S) int64 -> logits (B, S, V); on a pipeline stage, hidden states in and/or out.
        positions, documents: (B, S) int64 of packed rows, each token's position inside its document and the
        document's index in the row (both or neither); attention then stays inside each document."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        cos, sin = self.rope_cos, self.rope_sin
        if positions is not None:
            cos, sin = cos[positions], sin[positions]
        elif self.positions is not None:
            cos, sin = cos[self.positions], sin[self.positions]
        mask = document_mask(documents) if documents is not None else None
        for layer in self.layers.values():
            h = layer(h, cos, sin) if mask is None else layer(h, cos, sin, mask=mask)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def param_init_std(name: str, args: LlamaArgs) -> float | None:
    """Initial std for a parameter by its name; None means ones (norm weights)."""
    leaf = name.rsplit(".", 2)
    if name.endswith("norm.weight") or "_norm." in name:
        return None
    if "tok_embeddings" in name:
        return 1.0
    if name.startswith("output") or ".output." in name:
        return args.dim**-0.5
    if leaf[-2] in ("wo", "w2"):  # residual projections scaled by depth (GPT-2 / torchtitan convention)
        return 0.02 / math.sqrt(2 * args.n_layers)
    return 0.02
