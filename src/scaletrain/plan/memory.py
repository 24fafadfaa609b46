"""Memory per rank, bytes: model states, activations, fixed overheads, each its own line.

Two kinds of functions live here:
- reference formulas from the literature (ZeRO's model states, Korthikanti's GPT activations), tested against the
  published numbers;
- the model of what scaletrain's trainer actually allocates for its Llama block: fp32 master weights, fp32
  gradients and AdamW states (precision.dtype is the compute dtype only), FSDP2 gathering one block at a time with
  the root (embeddings, output) kept gathered, accumulation without gradient sync, activation bytes counted from
  the tensors the block saves for backward (tests measure them).
"""

from __future__ import annotations

import numpy as np

from scaletrain.config.precisions import PRECISIONS
from scaletrain.hardware.cluster import Cluster
from scaletrain.models.spec import DecoderShape
from scaletrain.plan.layout import LayoutGrid, Workload
from scaletrain.plan.pipeline import activations_in_flight, schedule_column, v_shaped
from scaletrain.plan.shapes import layout_columns, rank_params

# ---- fixed overheads (formulas.md: "budget 1-2 GB per GPU for CUDA context and NCCL buffers", as own lines) ----
CUDA_CONTEXT_BYTES = 0.5e9  # unconfirmed: CUDA context + cuBLAS/cuDNN workspaces, typical 0.3-0.6 GB
NCCL_BYTES_PER_GROUP = 0.25e9  # unconfirmed: NCCL_BUFFSIZE 4 MiB x up to 32 channels x 2, per communicator
FRAGMENTATION_SHARE = 0.05  # unconfirmed: caching-allocator slack on the short-lived allocations
DDP_BUCKET_CAP_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb (ParallelConfig.ddp_bucket_cap_mb)

MEMORY_LINES = (
    "parameters",
    "gradients",
    "optimizer states",
    "gathered/cast weights",
    "activations",
    "recompute working set",
    "output layer + loss",
    "comm buffers",
    "CUDA context",
    "fragmentation",
)


# ------------------------------------------------------------------------------------------ reference formulas
def zero_model_state_bytes(n_params: float, n_d: int, stage: int, k: float = 12.0) -> float:
    """Model-state bytes per GPU for mixed-precision Adam under ZeRO stage 0-3 (Rajbhandari et al. 2020):
    2Ψ fp16 params + 2Ψ fp16 grads + KΨ optimizer states (fp32 master, momentum, variance), K = 12."""
    p, g, o = 2.0 * n_params, 2.0 * n_params, k * n_params
    if stage == 0:
        return p + g + o
    if stage == 1:
        return p + g + o / n_d
    if stage == 2:
        return p + (g + o) / n_d
    if stage == 3:
        return (p + g + o) / n_d
    raise ValueError(f"ZeRO stage must be 0-3 (got {stage})")


def korthikanti_layer_activation_bytes(
    s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False, recompute: str = "none"
) -> float:
    """Activation bytes of one GPT-2-style transformer layer with 16-bit activations (Korthikanti et al. 2022,
    Table 2): s sequence, b micro-batch, h hidden, a heads, t tensor-parallel degree."""
    sbh = s * b * h
    score = 5.0 * a * s / (h * t)  # the s x s attention scores, softmax, dropout mask and output
    if recompute == "full":
        return 2.0 * sbh
    if recompute == "selective":
        return sbh * (34.0 / t) if sequence_parallel else sbh * (10.0 + 24.0 / t)
    if recompute != "none":
        raise ValueError(f"recompute must be none, selective or full (got {recompute!r})")
    if sequence_parallel:
        return sbh * (34.0 / t + score)
    return sbh * (10.0 + 24.0 / t + score)


def gpt_layer_saved_tensor_bytes(s: int, b: int, h: int, a: int) -> dict[str, float]:
    """The GPT-2 layer's saved tensors one by one (16-bit activations, 1-byte dropout masks), as Korthikanti et al.
    count them; they sum to s·b·h·(34 + 5·a·s/h)."""
    sbh, as2b = s * b * h, a * s * s * b
    return {
        "layernorm 1 input": 2 * sbh,
        "QKV input": 2 * sbh,
        "Q and K (for QK^T)": 4 * sbh,
        "softmax output": 2 * as2b,
        "attention dropout mask": as2b,
        "attention dropout output": 2 * as2b,
        "V": 2 * sbh,
        "output projection input": 2 * sbh,
        "attention residual dropout mask": sbh,
        "layernorm 2 input": 2 * sbh,
        "MLP input": 2 * sbh,
        "GeLU input": 8 * sbh,
        "GeLU output": 8 * sbh,
        "MLP dropout mask": sbh,
    }


# ---------------------------------------------------------------------------- the Llama block scaletrain builds
def rmsnorm_saved_bytes_per_token(h: int, elem_bytes, fused: bool = True):
    """Bytes one RMSNorm saves per token: the fused CUDA kernel keeps its input and a fp32 rstd; the composite
    path (CPU) upcasts and keeps two fp32 copies of the row plus rstd."""
    return (elem_bytes * h + 4.0) if fused else (8.0 * h + 4.0)


def layer_activation_bytes_per_token(args: DecoderShape, elem_bytes, tp=1, ac: str = "none", fused_norm: bool = True):
    """Bytes one Llama block (RMSNorm, GQA attention through SDPA/flash, SwiGLU) keeps for backward per token.

    Counted from the tensors autograd saves (tests measure them on CPU):
    none: 2 norms + 2 norm outputs (linear inputs) + q, repeated k, repeated v, attention output (4 × h)
          + log-sum-exp (fp32 per head) + SwiGLU's gate, SiLU output, up and product (4 × ffn).
          bf16, fused norms: 16h + 8·ffn + 4a + 8 bytes (44·h for Llama 3 8B; GPT-2's block is 34·h).
    selective: save only matmul and attention outputs and the block input, recompute norms, RoPE, repeats, SiLU
          (op-level selective checkpointing): e·(5h + 2·kv + 2·ffn) + 4a.
    full: the block input only, e·h.
    Tensor parallelism (tp > 1) assumes sequence parallelism with DTensor: norm inputs and block inputs are
    sharded over the sequence, the gathered linear inputs are kept whole, head and FFN tensors are sharded.
    """
    e = np.asarray(elem_bytes, dtype=np.float64)
    t = np.asarray(tp, dtype=np.float64)
    h, f, a = float(args.dim), float(args.ffn_dim), float(args.n_heads)
    kv = args.n_kv_heads * args.head_dim
    kv_local = np.where(t <= args.n_kv_heads, kv / t, float(args.head_dim))
    if ac == "full":
        return e * h / t
    if ac == "selective":
        return e * h / t * 3 + 2 * e * kv_local + 4 * a / t + 2 * e * f / t + 2 * e * h
    if ac != "none":
        raise ValueError(f"activation checkpointing must be none, selective or full (got {ac!r})")
    norm = rmsnorm_saved_bytes_per_token(args.dim, e, fused_norm)
    return 2 * norm / t + 2 * e * h + 4 * e * h / t + 4 * a / t + 4 * e * f / t


def cp_extra_activation_bytes_per_token(args: DecoderShape, elem_bytes, tp, cp, ac_code):
    """Bytes per local token one block keeps on top of layer_activation_bytes_per_token under context parallelism
    (all-gather method): attention keeps K and V of the whole sequence, cp times its own tokens. Without
    checkpointing they are the repeated K and V (every query head: 2h per token); selective checkpointing keeps
    the gathered KV heads (the all-gather's output) and recomputes the repeat; full keeps the block input only."""
    e = np.asarray(elem_bytes, dtype=np.float64)
    t = np.asarray(tp, dtype=np.float64)
    kv = args.n_kv_heads * args.head_dim
    kv_local = np.where(t <= args.n_kv_heads, kv / t, float(args.head_dim))
    per_global = np.select(
        [np.asarray(ac_code) == 0, np.asarray(ac_code) == 1], [2 * e * args.dim / t, 2 * e * kv_local], 0.0
    )
    return per_global * (np.asarray(cp, dtype=np.float64) - 1.0)


def cp_mask_bytes(seq_len: int, cp, elem_bytes):
    """The all-gather method's additive causal mask over global positions in the compute dtype: (S/cp) x S
    elements, built once (shared by every block, every sample and every micro-batch)."""
    return np.asarray(elem_bytes, dtype=np.float64) * (seq_len / np.asarray(cp, dtype=np.float64)) * seq_len


def output_layer_saved_bytes_per_token(args: DecoderShape, elem_bytes, tp=1, fused_norm: bool = True):
    """Bytes the final norm, output projection and cross-entropy save for backward per token: norm, the
    projection's input, fp32 log-softmax output (vocabulary sharded with loss parallelism), int64 target."""
    e = np.asarray(elem_bytes, dtype=np.float64)
    t = np.asarray(tp, dtype=np.float64)
    h, v = float(args.dim), float(args.vocab_size)
    return rmsnorm_saved_bytes_per_token(args.dim, e, fused_norm) / t + e * h + 4.0 * v / t + 8.0


def output_layer_transient_bytes_per_token(args: DecoderShape, elem_bytes, tp=1):
    """Short-lived bytes at the loss per token on top of what is saved: the logits in the compute dtype and their
    fp32 copy (or, in backward, their gradients) — the trainer computes cross-entropy on logits.float()."""
    e = np.asarray(elem_bytes, dtype=np.float64)
    v = float(args.vocab_size) / np.asarray(tp, dtype=np.float64)
    return e * v + np.where(e < 4, 4.0 * v, 0.0)


def trainer_model_state_bytes(
    args: DecoderShape,
    tp: int = 1,
    pp: int = 1,
    dp_shard: int = 1,
    seq_len: int | None = None,
    stages_per_rank: int = 1,
    v_shaped: bool = False,
    pp_rank: int | None = None,
) -> dict[str, float]:
    """Bytes of parameters, gradients and AdamW states as scaletrain's trainer keeps them, on pipeline rank
    `pp_rank` (None: the rank that holds the most), stages split as the trainer splits them for seq_len-token
    samples: all fp32 (the compute dtype only changes gathered copies), FSDP2 sharding dim 0 of every tensor;
    optimizer states are exp_avg and exp_avg_sq plus one fp32 step counter per tensor."""
    per_rank = rank_params(args, tp, pp, dp_shard, seq_len, stages_per_rank if pp > 1 else 1, v_shaped)
    numel, tensors = max(per_rank) if pp_rank is None else per_rank[pp_rank]
    return {"parameters": 4.0 * numel, "gradients": 4.0 * numel, "optimizer states": 8.0 * numel + 4.0 * tensors}


# ---------------------------------------------------------------------------------------- per-layout breakdown
def memory_breakdown(
    work: Workload,
    grid: LayoutGrid,
    cluster: Cluster,
    cols: dict | None = None,
) -> dict[str, np.ndarray]:
    """Bytes per rank on the busiest rank for every layout of the grid, one array per line of MEMORY_LINES."""
    args = work.args
    cols = cols if cols is not None else layout_columns(work, grid)
    e = np.asarray([p.element_bytes for p in PRECISIONS], dtype=np.float64)[grid.precision]
    fsdp = grid.dp_shard * grid.cp > 1  # cp ranks join the FSDP shard group
    ddp = ~fsdp & (grid.dp_replicate > 1)
    m = grid.accumulation
    on_gpu = cluster.gpu.name != "cpu"

    lines: dict[str, np.ndarray] = {}
    lines["parameters"] = 4.0 * cols["n_local"]
    # accumulation without gradient sync keeps FSDP2's unsharded gradients (reduce dtype fp32) until the last one
    lines["gradients"] = np.where(fsdp & (m > 1), 4.0 * cols["n_tp"], 4.0 * cols["n_local"])
    lines["optimizer states"] = 8.0 * cols["n_local"] + 4.0 * cols["n_tensors"]
    gathered_fsdp = e * (2 * cols["layer_tp"] + cols["root_tp"]) + np.where(m > 1, 0.0, (e + 4) * cols["layer_tp"])
    autocast_copies = np.where(e < 4, e * cols["n_tp"], 0.0)  # autocast's cached low-precision weights (DDP)
    lines["gathered/cast weights"] = np.where(fsdp, gathered_fsdp, autocast_copies)

    tok = grid.micro_batch * work.seq_len / grid.cp
    fused = on_gpu
    act = np.zeros(len(grid))
    for code, mode in enumerate(("none", "selective", "full")):
        sel = grid.ac == code
        if sel.any():
            per = layer_activation_bytes_per_token(args, e[sel], grid.tp[sel], mode, fused)
            act[sel] = per * tok[sel]  # one block's, per micro-batch
    act = act + cp_extra_activation_bytes_per_token(args, e, grid.tp, grid.cp, grid.ac) * tok
    in_flight = activations_in_flight(grid.schedule, grid.pp, m, grid.virtual_stages)
    out = (
        output_layer_saved_bytes_per_token(args, e, grid.tp, fused)
        + output_layer_transient_bytes_per_token(args, e, grid.tp)
    ) * tok
    v_shape = v_shaped(grid.schedule)  # V schedules put the first and the last chunk on the same rank
    # a schedule that holds every micro-batch's activations (GPipe) holds them on the last rank too
    last_in_flight = np.where(schedule_column("in_flight", "")[grid.schedule] == "all", m, 1.0)
    # pipeline rank 0 keeps the most micro-batches in flight, the last rank adds the output layer: the larger
    first = act * cols["layers_first"] * in_flight
    last = act * cols["layers_head"] * last_in_flight + out
    lines["activations"] = np.where(
        (grid.pp == 1) | v_shape, first, np.where(first >= last, first, act * cols["layers_head"] * last_in_flight)
    ) + np.where(grid.cp > 1, cp_mask_bytes(work.seq_len, grid.cp, e), 0.0)
    lines["output layer + loss"] = np.where((grid.pp == 1) | v_shape | (last > first), out, 0.0)
    one_layer = layer_activation_bytes_per_token(args, e, grid.tp, "none", fused) * tok
    lines["recompute working set"] = np.where(grid.ac > 0, one_layer, 0.0)

    groups = (grid.dp_replicate > 1).astype(float) + fsdp + (grid.tp > 1) + (grid.pp > 1) + (grid.cp > 1)
    lines["comm buffers"] = np.where(ddp, 4.0 * cols["n_tp"], 0.0) + (NCCL_BYTES_PER_GROUP * groups if on_gpu else 0.0)
    lines["CUDA context"] = np.full(len(grid), CUDA_CONTEXT_BYTES if on_gpu else 0.0)
    dynamic = (
        lines["activations"]
        + lines["output layer + loss"]
        + lines["recompute working set"]
        + lines["gathered/cast weights"]
    )
    lines["fragmentation"] = FRAGMENTATION_SHARE * dynamic
    return lines


def total_bytes(lines: dict[str, np.ndarray]) -> np.ndarray:
    return np.sum([lines[k] for k in MEMORY_LINES], axis=0)
