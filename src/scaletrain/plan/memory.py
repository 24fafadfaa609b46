"""Memory per rank, bytes: model states, activations, fixed overheads, each its own line.

Two kinds of functions live here:
- reference formulas from the literature (ZeRO's model states, Korthikanti's GPT activations), tested against the
  published numbers;
- the model of what scaletrain's trainer actually allocates for its Llama block: fp32 master weights, fp32
  gradients and AdamW states (precision.dtype is the compute dtype only), FSDP2 gathering one block at a time with
  the root (embeddings, output) kept gathered, accumulation into sharded gradients (parallel.fsdp_accumulate;
  torch's pipeline schedules accumulate unsharded), optional CPU offload of the shards, activation bytes counted
  from the tensors the block saves for backward (tests measure them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scaletrain.config.precisions import PRECISIONS
from scaletrain.hardware.cluster import Cluster
from scaletrain.models.spec import LOSS_CHUNK_TOKENS, DecoderShape
from scaletrain.plan.layout import LayoutGrid, Workload
from scaletrain.plan.lora import LoraShape, adapter_activation_bytes_per_token, layer_adapter_params, layer_quantized
from scaletrain.plan.pipeline import activations_in_flight, schedule_column, v_shaped
from scaletrain.models.stages import rank_layers
from scaletrain.plan.shapes import layout_columns, rank_params, stage_balance

# ---- fixed overheads (formulas.md: "budget 1-2 GB per GPU for CUDA context and NCCL buffers", as own lines) ----
CUDA_CONTEXT_BYTES = 0.5e9  # unconfirmed: CUDA context + cuBLAS/cuDNN workspaces, typical 0.3-0.6 GB
NCCL_BYTES_PER_GROUP = 0.25e9  # unconfirmed: NCCL_BUFFSIZE 4 MiB x up to 32 channels x 2, per communicator
FRAGMENTATION_SHARE = 0.05  # unconfirmed: caching-allocator slack on the short-lived allocations
# foreach AdamW's one full-size temporary: _foreach_sqrt(exp_avg_sqs), an fp32 list as large as the parameters
# (torch/optim/adam.py _multi_tensor_adam; the other foreach ops work in place)
OPTIMIZER_TEMP_BYTES = 4.0
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


@dataclass(frozen=True)
class MemoryOptions:
    """Trainer options that change memory but are not searched as layout columns (config fields in brackets)."""

    fsdp_accumulate: str = "sharded"  # [parallel.fsdp_accumulate] sharded | unsharded
    cpu_offload: bool = False  # [parallel.cpu_offload] FSDP2 shards, gradients and AdamW states in host memory
    # the built-in Llama's unrepeated GQA k/v and recomputed SiLU, and the chunked cross-entropy (both default on)
    lean_activations: bool = True


DEFAULT_MEMORY_OPTIONS = MemoryOptions()


def holds_unsharded_grads(fsdp, pp, accumulation, fsdp_accumulate: str = "sharded"):
    """Whether FSDP2 keeps whole (unsharded, fp32) gradients across micro-batches: when accumulating without
    gradient sync (fsdp_accumulate="unsharded"), and always inside torch's pipeline schedules, whose stages
    call set_requires_gradient_sync(False) until their last backward."""
    m = np.asarray(accumulation)
    return np.asarray(fsdp) & (m > 1) & ((fsdp_accumulate == "unsharded") | (np.asarray(pp) > 1))


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


def layer_activation_bytes_per_token(
    args: DecoderShape, elem_bytes, tp=1, ac: str = "none", fused_norm: bool = True, lean: bool = True
):
    """Bytes one Llama block (RMSNorm, GQA attention through SDPA/flash, SwiGLU) keeps for backward per token.

    Counted from the tensors autograd saves (tests measure them on CPU):
    none, lean=False: 2 norms + 2 norm outputs (linear inputs) + q, repeated k, repeated v, attention output
          (4 × h) + log-sum-exp (fp32 per head) + SwiGLU's gate, SiLU output, up and product (4 × ffn).
          bf16, fused norms: 16h + 8·ffn + 4a + 8 bytes (44·h for Llama 3 8B; GPT-2's block is 34·h).
    none, lean=True (the model's default, models/llama/model.py): k and v unrepeated (2 × kv instead of 2 × h;
          not on CUDA fp32, whose SDPA kernel needs them repeated) and SiLU recomputed (3 × ffn):
          bf16, fused norms: 12h + 4·kv + 6·ffn + 4a + 8 bytes (34·h for Llama 3 8B, Megatron's 34·s·b·h).
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
    # fused_norm=False stands for the CPU, where SDPA takes unrepeated k/v in every dtype
    gqa = lean & ((e < 4) | (not fused_norm))
    attention = np.where(gqa, 2 * e * h / t + 2 * e * kv_local, 4 * e * h / t)
    swiglu = (3 if lean else 4) * e * f / t
    return 2 * norm / t + 2 * e * h + attention + 4 * a / t + swiglu


def cp_extra_activation_bytes_per_token(
    args: DecoderShape, elem_bytes, tp, cp, ac_code, fused_norm: bool = True, lean: bool = True
):
    """Bytes per local token one block keeps on top of layer_activation_bytes_per_token under context parallelism
    (all-gather method): attention keeps K and V of the whole sequence, cp times its own tokens. Without
    checkpointing they are the repeated K and V (every query head: 2h per token); selective checkpointing keeps
    the gathered KV heads (the all-gather's output) and recomputes the repeat; full keeps the block input only.
    The all-gather attention always repeats K and V, so where the lean block would have kept its own tokens' K and V
    unrepeated (SDPA's enable_gqa), the repeated local copy is counted instead."""
    e = np.asarray(elem_bytes, dtype=np.float64)
    t = np.asarray(tp, dtype=np.float64)
    kv = args.n_kv_heads * args.head_dim
    kv_local = np.where(t <= args.n_kv_heads, kv / t, float(args.head_dim))
    per_global = np.select(
        [np.asarray(ac_code) == 0, np.asarray(ac_code) == 1], [2 * e * args.dim / t, 2 * e * kv_local], 0.0
    )
    c = np.asarray(cp, dtype=np.float64)
    gqa = lean & ((e < 4) | (not fused_norm))
    unrepeated = np.where(gqa & (np.asarray(ac_code) == 0), 2 * e * args.dim / t - 2 * e * kv_local, 0.0)
    return per_global * (c - 1.0) + np.where(c > 1, unrepeated, 0.0)


def cp_mask_bytes(seq_len: int, cp, elem_bytes):
    """The all-gather method's additive causal mask over global positions in the compute dtype: (S/cp) x S
    elements, built once (shared by every block, every sample and every micro-batch)."""
    return np.asarray(elem_bytes, dtype=np.float64) * (seq_len / np.asarray(cp, dtype=np.float64)) * seq_len


def _chunked_loss(tp, chunked: bool):
    """Whether cross-entropy runs in chunks (models/loss.py): on plain logits; vocabulary-sharded DTensor logits
    (loss parallelism, tp > 1) keep torch's sharded kernel."""
    return chunked & (np.asarray(tp) == 1)


def output_layer_saved_bytes_per_token(
    args: DecoderShape, elem_bytes, tp=1, fused_norm: bool = True, chunked_loss: bool = True
):
    """Bytes the final norm, output projection and cross-entropy save for backward per token: norm, the
    projection's input, int64 target, and the fp32 log-softmax output (vocabulary sharded with loss parallelism)
    or, with the chunked loss, only the logits in the compute dtype."""
    e = np.asarray(elem_bytes, dtype=np.float64)
    t = np.asarray(tp, dtype=np.float64)
    h, v = float(args.dim), float(args.vocab_size)
    logits = np.where(_chunked_loss(tp, chunked_loss), e * v, 4.0 * v / t)
    return rmsnorm_saved_bytes_per_token(args.dim, e, fused_norm) / t + e * h + logits + 8.0


def output_layer_transient_bytes_per_token(args: DecoderShape, elem_bytes, tp=1, chunked_loss: bool = True):
    """Short-lived bytes at the loss per token on top of what is saved: unchunked, the logits in the compute dtype
    and their fp32 copy (or, in backward, their gradients); chunked, the logits' gradient in the compute dtype
    (one chunk's fp32 working set is loss_chunk_bytes)."""
    e = np.asarray(elem_bytes, dtype=np.float64)
    v = float(args.vocab_size) / np.asarray(tp, dtype=np.float64)
    return np.where(_chunked_loss(tp, chunked_loss), e * v, e * v + np.where(e < 4, 4.0 * v, 0.0))


def loss_chunk_bytes(args: DecoderShape, tokens, tp=1, chunked_loss: bool = True):
    """One loss chunk's fp32 logits and log-softmax (forward, and again when backward recomputes it), bytes."""
    chunk = np.minimum(np.asarray(tokens, dtype=np.float64), LOSS_CHUNK_TOKENS)
    return np.where(_chunked_loss(tp, chunked_loss), 8.0 * float(args.vocab_size) * chunk, 0.0)


def trainer_model_state_bytes(
    args: DecoderShape,
    tp: int = 1,
    pp: int = 1,
    dp_shard: int = 1,
    seq_len: int | None = None,
    stages_per_rank: int = 1,
    v_shaped: bool = False,
    pp_rank: int | None = None,
    accumulation: int = 1,
    fsdp_accumulate: str = "sharded",
    lora: LoraShape | None = None,
) -> dict[str, float]:
    """Bytes of parameters, gradients and AdamW states as scaletrain's trainer keeps them, on pipeline rank
    `pp_rank` (None: the rank that holds the most), stages split as the trainer splits them for seq_len-token
    samples: all fp32 (the compute dtype only changes gathered copies), FSDP2 sharding dim 0 of every tensor;
    optimizer states are exp_avg and exp_avg_sq plus one fp32 step counter per tensor.
    gradients: the most the rank holds during a step of `accumulation` micro-batches: the sharded fp32 gradient,
    or FSDP2's whole fp32 gradients where it accumulates unsharded (holds_unsharded_grads).
    lora: the base is frozen (its parameters only) and the adapters of the rank's blocks alone have gradients and
    optimizer states (plan/lora.py)."""
    v = stages_per_rank if pp > 1 else 1
    per_rank = rank_params(args, tp, pp, dp_shard, seq_len, v, v_shaped)
    rank = max(range(pp), key=lambda r: per_rank[r]) if pp_rank is None else pp_rank
    numel, tensors = per_rank[rank]
    unsharded = bool(holds_unsharded_grads(dp_shard > 1, pp, accumulation, fsdp_accumulate))
    if lora is not None:
        layers = rank_layers(args, seq_len or args.max_seq_len, pp, v, v_shaped, stage_balance(args))[rank][0]
        adapters, adapter_tensors = (layers * n for n in layer_adapter_params(args, lora, tp, dp_shard))
        whole = layers * layer_adapter_params(args, lora, tp, 1)[0]
        q_numel, q_bytes, _ = layer_quantized(args, lora, dp_shard)  # QLoRA: 4-bit instead of fp32
        return {
            "parameters": 4.0 * (numel + adapters) - layers * (4.0 * q_numel - q_bytes),
            "gradients": 4.0 * (whole if unsharded else adapters),
            "optimizer states": 8.0 * adapters + 4.0 * adapter_tensors,
        }
    grads = 4.0 * numel
    if unsharded:
        grads = 4.0 * rank_params(args, tp, pp, 1, seq_len, v, v_shaped)[rank][0]
    return {"parameters": 4.0 * numel, "gradients": grads, "optimizer states": 8.0 * numel + 4.0 * tensors}


# ---------------------------------------------------------------------------------------- per-layout breakdown
def memory_breakdown(
    work: Workload,
    grid: LayoutGrid,
    cluster: Cluster,
    cols: dict | None = None,
    options: MemoryOptions = DEFAULT_MEMORY_OPTIONS,
) -> dict[str, np.ndarray]:
    """Bytes per rank on the busiest rank for every layout of the grid, one array per line of MEMORY_LINES.
    With options.cpu_offload, FSDP layouts keep their shards in host memory: see host_bytes_per_node."""
    args = work.args
    cols = cols if cols is not None else layout_columns(work, grid)
    e = np.asarray([p.element_bytes for p in PRECISIONS], dtype=np.float64)[grid.precision]
    fsdp = grid.sharded  # FSDP or HSDP (cp ranks join the shard group)
    ddp = grid.ddp
    m = grid.accumulation
    on_gpu = cluster.gpu.name != "cpu"

    lines: dict[str, np.ndarray] = {}
    unsharded = holds_unsharded_grads(fsdp, grid.pp, m, options.fsdp_accumulate)
    offloaded = fsdp & options.cpu_offload  # shards, sharded gradients and AdamW states live on the host
    # what is trained: every weight, or with LoRA the adapters alone (the frozen base has weights only)
    trained = _trained_columns(work, grid, cols)
    weights = cols["n_local"] + (trained["n_local"] if work.lora is not None else 0.0)
    # QLoRA: the adapted projections' base in NF4 instead of fp32 (plan/lora.py nf4_bytes); whole per block and
    # the largest weight, for what is gathered and the one weight dequantized at a time
    q = _quantized_columns(work, grid, cols)
    lines["parameters"] = np.where(offloaded, 0.0, 4.0 * weights - (4.0 * q["n_local"] - q["bytes"]))
    # unsharded accumulation keeps FSDP2's whole gradients (reduce dtype fp32, on the device) until the last one
    lines["gradients"] = np.where(unsharded, 4.0 * trained["n_tp"], np.where(offloaded, 0.0, 4.0 * trained["n_local"]))
    lines["optimizer states"] = np.where(offloaded, 0.0, 8.0 * trained["n_local"] + 4.0 * trained["n_tensors"])
    # two blocks gathered (one computing, one prefetched) + the root; a block's whole gradient in the compute dtype
    # and its fp32 reduce copy while it is reduce-scattered, unless whole gradients are already counted above.
    # torch's pipeline stages skip resharding after backward: the whole stage stays gathered
    adapters_tp = trained["n_tp"] if work.lora is not None else 0.0
    adapter_layer_tp = trained["layer_tp"] if work.lora is not None else 0.0
    # (QLoRA: a block's 4-bit base is gathered 4-bit, and one weight at a time is dequantized to the compute dtype)
    q_gathered = e * q["layer"] - q["layer_bytes"]  # what 4-bit saves on one gathered block
    gathered_fsdp = (
        np.where(
            grid.pp > 1,
            e * (cols["n_tp"] + adapters_tp) - cols["layers"] * q_gathered,
            e * (2 * (cols["layer_tp"] + adapter_layer_tp) + cols["root_tp"])
            - 2 * q_gathered
            + np.where(unsharded, 0.0, (e + 4) * trained["layer_tp"]),
        )
        + e * q["largest"]
    )
    # autocast's cached low-precision weights (DDP, one rank): every linear's, not the embedding's (autocast leaves
    # embedding lookups in fp32), which a rank without pipeline stages holds; a 4-bit weight is not cached but
    # dequantized when used, one at a time
    embedding = np.where(grid.pp == 1, float(args.vocab_size * args.dim) / grid.tp, 0.0)
    cast = e * (cols["n_tp"] + adapters_tp - embedding - q["n_local"]) + np.where(
        q["n_local"] > 0, e * q["largest"], 0.0
    )
    autocast_copies = np.where(e < 4, cast, 0.0)
    lines["gathered/cast weights"] = np.where(fsdp, gathered_fsdp, autocast_copies)

    tok = grid.micro_batch * work.seq_len / grid.cp
    fused = on_gpu
    act = np.zeros(len(grid))
    lean = options.lean_activations
    for code, mode in enumerate(("none", "selective", "full")):
        sel = grid.ac == code
        if sel.any():
            per = layer_activation_bytes_per_token(args, e[sel], grid.tp[sel], mode, fused, lean)
            if work.lora is not None and mode != "full":  # lora_B's inputs (and dropout's copies): matmul inputs
                per = per + adapter_activation_bytes_per_token(args, work.lora, e[sel], grid.tp[sel])
            act[sel] = per * tok[sel]  # one block's, per micro-batch
    act = act + cp_extra_activation_bytes_per_token(args, e, grid.tp, grid.cp, grid.ac, fused, lean) * tok
    in_flight = activations_in_flight(grid.schedule, grid.pp, m, grid.virtual_stages)
    out = (
        output_layer_saved_bytes_per_token(args, e, grid.tp, fused, lean)
        + output_layer_transient_bytes_per_token(args, e, grid.tp, lean)
    ) * tok + loss_chunk_bytes(args, tok, grid.tp, lean)
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
    one_layer = layer_activation_bytes_per_token(args, e, grid.tp, "none", fused, lean) * tok
    lines["recompute working set"] = np.where(grid.ac > 0, one_layer, 0.0)

    groups = (grid.dp_replicate > 1).astype(float) + fsdp + (grid.tp > 1) + (grid.pp > 1) + (grid.cp > 1)
    # DDP's buckets hold the gradients it all-reduces: the trained parameters'
    lines["comm buffers"] = np.where(ddp, 4.0 * trained["n_tp"], 0.0) + (
        NCCL_BYTES_PER_GROUP * groups if on_gpu else 0.0
    )
    lines["CUDA context"] = np.full(len(grid), CUDA_CONTEXT_BYTES if on_gpu else 0.0)
    dynamic = (
        lines["activations"]
        + lines["output layer + loss"]
        + lines["recompute working set"]
        + lines["gathered/cast weights"]
    )
    # one rank, one micro-batch: the gradients and the activations are never held at once. zero_grad(set_to_none)
    # freed the last step's gradients, so at the start of backward, when the activations peak, only the output
    # layer's gradient exists; backward then frees a block's activations as it makes the block's gradients, and the
    # optimizer step holds every gradient plus foreach AdamW's sqrt(v) list (OPTIMIZER_TEMP_BYTES per parameter).
    # The gradients line is what gradients add to the larger of the two peaks.
    alone = (grid.dp_replicate * grid.dp_shard * grid.tp * grid.pp * grid.cp == 1) & (m == 1)
    output_grad = 4.0 * float(args.vocab_size * args.dim) if work.lora is None else 0.0  # LoRA: output frozen
    step_peak = lines["gradients"] + OPTIMIZER_TEMP_BYTES * trained["n_local"]
    lines["gradients"] = np.where(alone, np.maximum(output_grad, step_peak - dynamic), lines["gradients"])
    lines["fragmentation"] = FRAGMENTATION_SHARE * dynamic
    return lines


def _trained_columns(work: Workload, grid: LayoutGrid, cols: dict) -> dict[str, np.ndarray]:
    """The trained parameters' columns, as param_columns names them (n_local, n_tensors, n_tp, layer_tp): every
    parameter's (cols itself), or with LoRA the adapters' of the busiest rank's blocks (plan/lora.py)."""
    if work.lora is None:
        return cols
    shard = np.asarray(grid.dp_shard * grid.cp)
    keys = np.stack([np.asarray(grid.tp), shard], axis=1).astype(np.int64)
    uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
    per = np.array(
        [
            (
                *layer_adapter_params(work.args, work.lora, int(t), int(d)),
                layer_adapter_params(work.args, work.lora, int(t))[0],
            )
            for t, d in uniq
        ],
        dtype=np.float64,
    ).reshape(-1, 3)[inverse.reshape(-1)]
    layers = cols["layers"]
    return {
        "n_local": layers * per[:, 0],
        "n_tensors": layers * per[:, 1],
        "n_tp": layers * per[:, 2],
        "layer_tp": per[:, 2],
    }


def _quantized_columns(work: Workload, grid: LayoutGrid, cols: dict) -> dict[str, np.ndarray]:
    """QLoRA's 4-bit base per layout (plan/lora.py layer_quantized): n_local / bytes on the busiest rank (its
    blocks, sharded by FSDP2), layer / layer_bytes of one whole block, largest: the largest whole weight; all zero
    without lora.quantize."""
    zero = np.zeros(len(grid))
    if work.lora is None or not work.lora.quantize:
        return {k: zero for k in ("n_local", "bytes", "layer", "layer_bytes", "largest")}
    shard = np.asarray(grid.dp_shard * grid.cp, dtype=np.int64)
    uniq, inverse = np.unique(shard, return_inverse=True)
    local = np.array([layer_quantized(work.args, work.lora, int(d))[:2] for d in uniq], dtype=np.float64)
    local = local[inverse.reshape(-1)]
    numel, size, largest = layer_quantized(work.args, work.lora)
    layers = cols["layers"]
    return {
        "n_local": layers * local[:, 0],
        "bytes": layers * local[:, 1],
        "layer": zero + numel,
        "layer_bytes": zero + size,
        "largest": zero + largest,
    }


def host_bytes_per_node(
    work: Workload,
    grid: LayoutGrid,
    cluster: Cluster,
    cols: dict | None = None,
    options: MemoryOptions = DEFAULT_MEMORY_OPTIONS,
) -> np.ndarray:
    """Host memory per node that CPU offload takes, bytes: every local rank's fp32 shards, sharded gradients
    and AdamW states (0 where nothing is offloaded)."""
    cols = cols if cols is not None else layout_columns(work, grid)
    trained = _trained_columns(work, grid, cols)
    frozen = cols["n_local"] if work.lora is not None else 0.0  # LoRA's base: fp32 weights only
    per_rank = 4.0 * frozen + 16.0 * trained["n_local"] + 4.0 * trained["n_tensors"]
    offloaded = (grid.dp_shard > 1) & options.cpu_offload
    return np.where(offloaded, per_rank * min(cluster.gpus_per_node, cluster.gpus), 0.0)


def total_bytes(lines: dict[str, np.ndarray]) -> np.ndarray:
    return np.sum([lines[k] for k in MEMORY_LINES], axis=0)
