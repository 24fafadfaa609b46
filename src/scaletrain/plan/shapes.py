"""The model as the planner counts it: parameters per rank after the trainer's pipeline split, tensor and FSDP
sharding; FLOPs per token. Derived from a DecoderShape without building
anything."""

from __future__ import annotations

import math
from functools import lru_cache

from scaletrain.models.spec import DecoderShape
from scaletrain.models.stages import rank_layers

# how tensor parallelism shards each weight (parallel/tensor_parallel.py): colwise linears on dim 0, rowwise on
# dim 1; the embedding on the hidden dim (1), the output layer on the vocabulary (0); norms are replicated
_TP_DIM = {"q": 0, "k": 0, "v": 0, "gate": 0, "up": 0, "o": 1, "down": 1, "embedding": 1, "output": 0}
# Megatron's GPT block: column-parallel biases split with their weights, row-parallel biases and LayerNorms replicated
_TP_DIM.update({"q_bias": 0, "k_bias": 0, "v_bias": 0, "up_bias": 0})


def layer_param_shapes(args: DecoderShape) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of one transformer block's parameters, in the order the block registers them."""
    h, kv = args.dim, args.n_kv_heads * args.head_dim
    if args.block == "gpt":
        f = args.ffn_dim
        return [
            ("attention_norm", (h,)),
            ("attention_norm_bias", (h,)),
            ("q", (h, h)),
            ("q_bias", (h,)),
            ("k", (h, h)),
            ("k_bias", (h,)),
            ("v", (h, h)),
            ("v_bias", (h,)),
            ("o", (h, h)),
            ("o_bias", (h,)),
            ("ffn_norm", (h,)),
            ("ffn_norm_bias", (h,)),
            ("up", (f, h)),
            ("up_bias", (f,)),
            ("down", (h, f)),
            ("down_bias", (h,)),
        ]
    return [
        ("attention_norm", (h,)),
        ("q", (args.n_heads * args.head_dim, h)),
        ("k", (kv, h)),
        ("v", (kv, h)),
        ("o", (h, args.n_heads * args.head_dim)),
        ("ffn_norm", (h,)),
        ("gate", (args.ffn_dim, h)),
        ("down", (h, args.ffn_dim)),
        ("up", (args.ffn_dim, h)),
    ]


def _shard_rows(n: int, parts: int) -> int:
    """Rows rank 0 keeps when torch.chunk splits n rows into `parts` (FSDP2's dim-0 sharding; rank 0 is largest)."""
    return min(n, -(-n // parts))


def local_numel(name: str, shape: tuple[int, ...], tp: int, dp_shard: int) -> int:
    """Elements of one parameter on the largest rank after TP (parallel/tensor_parallel.py) and FSDP2 dim-0 sharding."""
    dims = list(shape)
    tp_dim = _TP_DIM.get(name)
    if tp > 1 and tp_dim is not None and tp_dim < len(dims):
        dims[tp_dim] = -(-dims[tp_dim] // tp)
    if dp_shard > 1:
        dims[0] = _shard_rows(dims[0], dp_shard)
    return math.prod(dims)


@lru_cache(maxsize=8192)
def rank_params(
    args: DecoderShape,
    tp: int,
    pp: int,
    dp_shard: int,
    seq_len: int | None = None,
    stages_per_rank: int = 1,
    v_shaped: bool = False,
) -> tuple[tuple[int, int], ...]:
    """(parameter elements, parameter tensors) of each pipeline rank's largest data-parallel rank, after the
    trainer's stage split (models/stages.py), TP (parallel/tensor_parallel.py) and FSDP2's dim-0 sharding."""
    layer = sum(local_numel(n, s, tp, dp_shard) for n, s in layer_param_shapes(args))
    n_layer_tensors = len(layer_param_shapes(args))
    emb = local_numel("embedding", (args.vocab_size, args.dim), tp, dp_shard)
    head = local_numel("norm", (args.dim,), tp, dp_shard) + local_numel(
        "output", (args.vocab_size, args.dim), tp, dp_shard
    )
    out = []
    seq = seq_len or args.max_seq_len
    for layers, has_emb, has_head in rank_layers(args, seq, pp, stages_per_rank, v_shaped, stage_balance(args)):
        out.append(
            (layers * layer + has_emb * emb + has_head * head, layers * n_layer_tensors + has_emb + 2 * has_head)
        )
    return tuple(out)


def params_per_rank(
    args: DecoderShape,
    tp: int,
    pp: int,
    dp_shard: int,
    seq_len: int | None = None,
    stages_per_rank: int = 1,
    v_shaped: bool = False,
) -> tuple[int, int]:
    """(parameter elements, parameter tensors) on the rank that holds the most; exact for that rank."""
    return max(rank_params(args, tp, pp, dp_shard, seq_len, stages_per_rank, v_shaped))


def stage_balance(args: DecoderShape) -> str:
    """How pipeline stages are cut: scaletrain's trainer balances estimated cost; Megatron-LM (the GPT block's
    runs) gives every stage the same number of layers."""
    return "layers" if args.block == "gpt" else "cost"


def layer_params(args: DecoderShape) -> int:
    """Parameters of one transformer block."""
    return sum(math.prod(s) for _, s in layer_param_shapes(args))


def matmul_flops_per_token_layer(args: DecoderShape) -> float:
    """Forward FLOPs of one block's weight matmuls per token (2 per multiply-add)."""
    return 2.0 * sum(math.prod(s) for n, s in layer_param_shapes(args) if len(s) == 2)


def attention_flops_per_token_layer(args: DecoderShape, seq_len: int) -> float:
    """Forward FLOPs of causal attention (QK^T and AV, half the square masked) per token, one block."""
    return 2.0 * seq_len * args.n_heads * args.head_dim


def output_flops_per_token(args: DecoderShape) -> float:
    """Forward FLOPs of the output projection per token."""
    return 2.0 * args.dim * args.vocab_size


def decoder_shape_for_params(n_params: float, vocab_size: int = 128256, seq_len: int = 8192) -> DecoderShape:
    """A Llama-3-shaped model of about `n_params` parameters: head size 128, 8 KV heads, FFN ~3.5 x dim,
    depth ~ dim / 128 (the aspect ratio of Llama 3.1 8B and 405B)."""
    if n_params < 1e8:
        raise ValueError(f"--params: {n_params:.3g} is too small for a Llama-shaped model; use at least 1e8")
    # per block ~ 12.5 h^2 (attention 2h^2 + small GQA share, SwiGLU 3 x 3.5 h^2), L ~ h / 128
    dim = (n_params * 128 / 12.5) ** (1 / 3)
    dim = max(1024, int(round(dim / 1024)) * 1024)
    ffn = int(round(3.5 * dim / 256)) * 256
    probe = DecoderShape(
        dim=dim, n_layers=1, n_heads=dim // 128, n_kv_heads=8, ffn_dim=ffn, vocab_size=vocab_size, max_seq_len=seq_len
    )
    per_layer = layer_params(probe)
    layers = max(1, round((n_params - 2 * vocab_size * dim) / per_layer))
    return DecoderShape(
        dim=dim,
        n_layers=layers,
        n_heads=dim // 128,
        n_kv_heads=8,
        ffn_dim=ffn,
        vocab_size=vocab_size,
        max_seq_len=seq_len,
    )


def param_columns(
    args: DecoderShape, tp, pp, dp_shard, seq_len: int | None = None, stages_per_rank=1, v_shaped=False
) -> dict:
    """Per-layout counts for equal-length arrays (tp, pp, dp_shard, stages_per_rank, v_shaped), the stages split
    as the trainer splits them:
    n_local, n_tensors (parameter elements and tensors on the rank that holds the most), n_tp (that rank's elements
    after TP only: what FSDP gathers or DDP all-reduces), layers (blocks on that rank), layers_first (blocks on
    pipeline rank 0, which keeps the most micro-batches in flight), layers_head (blocks on the rank with the
    output layer), layers_body (most blocks on a rank without the output layer; 0 if none), layer_tp (one block's
    elements after TP), root_tp (embedding, final norm and output after TP)."""
    import numpy as np

    n = len(np.asarray(tp))
    keys = np.stack(
        [
            np.asarray(tp),
            np.asarray(pp),
            np.asarray(dp_shard),
            np.broadcast_to(np.asarray(stages_per_rank), n),
            np.broadcast_to(np.asarray(v_shaped), n),
        ],
        axis=1,
    ).astype(np.int64)
    uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
    seq = seq_len or args.max_seq_len
    rows = []
    for t, p, d, v, shape in (map(int, k) for k in uniq):
        v = v if p > 1 else 1
        per_rank = rank_params(args, t, p, d, seq, v, bool(shape))
        big = max(range(p), key=lambda r: per_rank[r])
        layers = rank_layers(args, seq, p, v, bool(shape), stage_balance(args))
        body = [lay for lay, _, head in layers if not head]
        head_layers = next(lay for lay, _, head in layers if head)
        rows.append(
            per_rank[big]
            + (
                rank_params(args, t, p, 1, seq, v, bool(shape))[big][0],
                layers[big][0],
                layers[0][0],
                head_layers,
                max(body, default=0),
            )
        )
    cols = np.array(rows, dtype=np.float64)[inverse.reshape(-1)]
    tp_f = np.asarray(tp, dtype=np.float64)
    layer_tp = _layer_tp_lookup(args, tp_f)
    root = (local_numel("embedding", (args.vocab_size, args.dim), 1, 1) * 2 + args.dim) / tp_f
    return {
        "n_local": cols[:, 0],
        "n_tensors": cols[:, 1],
        "n_tp": cols[:, 2],
        "layers": cols[:, 3],
        "layers_first": cols[:, 4],
        "layers_head": cols[:, 5],
        "layers_body": cols[:, 6],
        "layer_tp": layer_tp,
        "root_tp": root,
    }


def layout_columns(work, grid) -> dict:
    """param_columns for a plan.layout.Workload and LayoutGrid (V-shaped schedules place stages as a V); FSDP
    shards over dp_shard x cp, as the trainer does (parallel/dims.py FSDP_SHARD_DIM)."""
    from scaletrain.plan.pipeline import v_shaped

    shard = grid.dp_shard * grid.cp
    return param_columns(work.args, grid.tp, grid.pp, shard, work.seq_len, grid.virtual_stages, v_shaped(grid.schedule))


def _layer_tp_lookup(args: DecoderShape, tp_f):
    import numpy as np

    uniq, inverse = np.unique(tp_f, return_inverse=True)
    vals = np.array(
        [sum(local_numel(n, s, int(t), 1) for n, s in layer_param_shapes(args)) for t in uniq], dtype=np.float64
    )
    return vals[inverse.reshape(-1)]
