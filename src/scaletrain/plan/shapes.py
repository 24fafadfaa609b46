"""The model as the planner counts it: parameter shapes per pipeline stage, parameters per rank after tensor and
FSDP sharding, FLOPs per token. Derived from LlamaArgs without building anything."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from scaletrain.models.llama import LlamaArgs

# how tensor parallelism shards each weight (torchtitan's Llama plan): colwise = dim 0, rowwise = dim 1;
# embeddings are sharded on the vocabulary (dim 0); norms are replicated
_TP_DIM = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "wo": 1, "w2": 1, "tok_embeddings": 0, "output": 0}


def layer_param_shapes(args: LlamaArgs) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of one transformer block's parameters, in the order the block registers them."""
    h, kv = args.dim, args.n_kv_heads * args.head_dim
    return [("attention_norm", (h,)), ("wq", (args.n_heads * args.head_dim, h)), ("wk", (kv, h)),
            ("wv", (kv, h)), ("wo", (h, args.n_heads * args.head_dim)), ("ffn_norm", (h,)),
            ("w1", (args.ffn_dim, h)), ("w2", (h, args.ffn_dim)), ("w3", (args.ffn_dim, h))]


def stage_param_shapes(args: LlamaArgs, pp: int = 1, stage: int = 0) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter pipeline stage `stage` of `pp` owns (layers split evenly, the first stages
    taking one more when L % pp != 0; embedding on the first stage, final norm and output on the last)."""
    first, count = stage_layers(args.n_layers, pp, stage)
    shapes = []
    if stage == 0:
        shapes.append(("tok_embeddings", (args.vocab_size, args.dim)))
    for _ in range(count):
        shapes.extend(layer_param_shapes(args))
    if stage == pp - 1:
        shapes += [("norm", (args.dim,)), ("output", (args.vocab_size, args.dim))]
    return shapes


def stage_layers(n_layers: int, pp: int, stage: int) -> tuple[int, int]:
    """(first layer, number of layers) of pipeline stage `stage`."""
    base, extra = divmod(n_layers, pp)
    count = base + (1 if stage < extra else 0)
    first = stage * base + min(stage, extra)
    return first, count


def _shard_rows(n: int, parts: int) -> int:
    """Rows rank 0 keeps when torch.chunk splits n rows into `parts` (FSDP2's dim-0 sharding; rank 0 is largest)."""
    return min(n, -(-n // parts))


def local_numel(name: str, shape: tuple[int, ...], tp: int, dp_shard: int) -> int:
    """Elements of one parameter on the largest rank after TP (torchtitan plan) and FSDP2 dim-0 sharding."""
    dims = list(shape)
    tp_dim = _TP_DIM.get(name)
    if tp > 1 and tp_dim is not None and tp_dim < len(dims):
        dims[tp_dim] = -(-dims[tp_dim] // tp)
    if dp_shard > 1:
        dims[0] = _shard_rows(dims[0], dp_shard)
    return math.prod(dims)


@lru_cache(maxsize=8192)
def params_per_rank(args: LlamaArgs, tp: int, pp: int, dp_shard: int) -> tuple[int, int]:
    """(parameter elements, parameter tensors) on the largest rank of the largest pipeline stage, after TP
    (torchtitan's plan) and FSDP2's dim-0 sharding; exact for the ranks that hold the most."""
    layer = sum(local_numel(n, s, tp, dp_shard) for n, s in layer_param_shapes(args))
    n_layer_tensors = len(layer_param_shapes(args))
    emb = local_numel("tok_embeddings", (args.vocab_size, args.dim), tp, dp_shard)
    head = local_numel("norm", (args.dim,), tp, dp_shard) + local_numel("output", (args.vocab_size, args.dim), tp,
                                                                        dp_shard)
    best = (0, 0)
    for stage in {0, min(1, pp - 1), pp - 1}:
        count = stage_layers(args.n_layers, pp, stage)[1]
        numel, tensors = count * layer, count * n_layer_tensors
        if stage == 0:
            numel, tensors = numel + emb, tensors + 1
        if stage == pp - 1:
            numel, tensors = numel + head, tensors + 2
        best = max(best, (numel, tensors))
    return best


@lru_cache(maxsize=4096)
def params_per_tp_rank(args: LlamaArgs, tp: int, pp: int) -> int:
    """Parameter elements of the largest stage after TP only (what FSDP gathers, or DDP keeps whole)."""
    return params_per_rank(args, tp, pp, 1)[0]


def layer_params(args: LlamaArgs) -> int:
    """Parameters of one transformer block."""
    return sum(math.prod(s) for _, s in layer_param_shapes(args))


def matmul_flops_per_token_layer(args: LlamaArgs) -> float:
    """Forward FLOPs of one block's weight matmuls per token (2 per multiply-add)."""
    return 2.0 * sum(math.prod(s) for n, s in layer_param_shapes(args) if len(s) == 2)


def attention_flops_per_token_layer(args: LlamaArgs, seq_len: int) -> float:
    """Forward FLOPs of causal attention (QK^T and AV, half the square masked) per token, one block."""
    return 2.0 * seq_len * args.n_heads * args.head_dim


def output_flops_per_token(args: LlamaArgs) -> float:
    """Forward FLOPs of the output projection per token."""
    return 2.0 * args.dim * args.vocab_size


def llama_args_for_params(n_params: float, vocab_size: int = 128256, seq_len: int = 8192) -> LlamaArgs:
    """A Llama-3-shaped model of about `n_params` parameters: head size 128, 8 KV heads, FFN ~3.5 x dim,
    depth ~ dim / 128 (the aspect ratio of Llama 3.1 8B and 405B)."""
    if n_params < 1e8:
        raise ValueError(f"--params: {n_params:.3g} is too small for a Llama-shaped model; use at least 1e8")
    # per block ~ 12.5 h^2 (attention 2h^2 + small GQA share, SwiGLU 3 x 3.5 h^2), L ~ h / 128
    dim = (n_params * 128 / 12.5) ** (1 / 3)
    dim = max(1024, int(round(dim / 1024)) * 1024)
    ffn = int(round(3.5 * dim / 256)) * 256
    probe = LlamaArgs(dim=dim, n_layers=1, n_heads=dim // 128, n_kv_heads=8, ffn_dim=ffn, vocab_size=vocab_size,
                      max_seq_len=seq_len, rope_theta=500000.0)
    per_layer = layer_params(probe)
    layers = max(1, round((n_params - 2 * vocab_size * dim) / per_layer))
    return LlamaArgs(dim=dim, n_layers=layers, n_heads=dim // 128, n_kv_heads=8, ffn_dim=ffn,
                     vocab_size=vocab_size, max_seq_len=seq_len, rope_theta=500000.0)


def param_columns(args: LlamaArgs, tp, pp, dp_shard) -> dict:
    """Per-layout parameter counts for equal-length arrays tp, pp, dp_shard:
    n_local (elements on the largest rank), n_tensors, n_tp (elements of the largest stage after TP only),
    layers (blocks on the largest stage), layer_tp (one block's elements after TP), root_tp (embedding, final norm
    and output after TP)."""
    import numpy as np

    keys = np.stack([np.asarray(tp), np.asarray(pp), np.asarray(dp_shard)], axis=1)
    uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    table = np.array([params_per_rank(args, int(t), int(p), int(d)) + (params_per_tp_rank(args, int(t), int(p)),
                                                                        stage_layers(args.n_layers, int(p), 0)[1])
                      for t, p, d in uniq], dtype=np.float64)
    cols = table[inverse]
    tp_f = np.asarray(tp, dtype=np.float64)
    layer_tp = _layer_tp_lookup(args, tp_f)
    root = (local_numel("tok_embeddings", (args.vocab_size, args.dim), 1, 1) * 2 + args.dim) / tp_f
    return {"n_local": cols[:, 0], "n_tensors": cols[:, 1], "n_tp": cols[:, 2], "layers": cols[:, 3],
            "layer_tp": layer_tp, "root_tp": root}


def _layer_tp_lookup(args: LlamaArgs, tp_f):
    import numpy as np

    uniq, inverse = np.unique(tp_f, return_inverse=True)
    vals = np.array([sum(local_numel(n, s, int(t), 1) for n, s in layer_param_shapes(args)) for t in uniq],
                    dtype=np.float64)
    return vals[inverse.reshape(-1)]
