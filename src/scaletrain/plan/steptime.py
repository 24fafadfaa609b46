"""Step time per layout, seconds, split into compute, exposed communication, pipeline bubble and optimizer.

Compute: FLOPs / (peak x achievable fraction): weight matmuls at the GPU's measured matmul ceiling, causal
attention at the fused-attention fraction (with a calibration: at bench's measured attention curve), pointwise ops as
bytes / memory bandwidth (CPU calibration: the bandwidth bench measured inside a real step), counted per block for
forward and backward; backward = 2 x forward's FLOPs;
full checkpointing re-runs the forward of every block, selective re-runs the pointwise ops.
Communication per micro-batch and per step from message sizes over the link each mesh dim crosses (comm.py);
FSDP gathers and DDP/FSDP gradient reductions overlap with compute (only what sticks out counts) as far as the
device lets them (GPUSpec.comm_overlap: NCCL fully, gloo on CPUs not at all); each FSDP unit and DDP bucket pays
the collective latency once. TP and PP traffic is exposed. The pipeline multiplies the micro-batch time by 1 + bubble
ratio (pipeline.py). Every micro-batch also pays the host's dispatch of its eager ops (OPS_PER_BLOCK x
Cluster.op_overhead_s): in line on a CPU, on a GPU only where it outlasts the kernels.
FP8 (Workload.fp8, bf16 layouts only): the blocks' weight matmuls run at the GPU's fp8 peak x the same measured
matmul ceiling (attention, the output layer and the loss stay bf16, as parallel/float8.py converts only the blocks'
linears), plus the casts to fp8 as memory traffic; with tensorwise scaling FSDP all-gathers those weights in fp8,
1 byte per element instead of 2 (comm.py's volumes scale with the bytes).
CPU hosts with a calibration (docs/planner.md, "CPU ranks sharing cores"): every FSDP, DDP and TP collective also
waits the measured extra of a collective amid compute for the compute gap before it; and where the ranks per host
outnumber its cores, the step is max(critical path at an uncontended core's pace, the slowest rank's work), so the
pipeline bubble costs only what the scheduler cannot fill with other ranks' work.
"""

from __future__ import annotations

import numpy as np

from scaletrain.hardware.cluster import Cluster
from scaletrain.plan.memory import DEFAULT_MEMORY_OPTIONS, MemoryOptions, holds_unsharded_grads
from scaletrain.plan.comm import collective_seconds, crosses_nodes, p2p_seconds
from scaletrain.plan.efficiency import (
    amid_compute_seconds,
    gemm_seconds,
    gpt_layer_seconds,
    llama_layer_seconds,
    memory_seconds,
    pointwise_seconds,
)
from scaletrain.config.precisions import PRECISION_NAMES, PRECISIONS
from scaletrain.config.layout import AC_MODES
from scaletrain.plan.layout import LayoutGrid, Workload
from scaletrain.plan.memory import DDP_BUCKET_CAP_BYTES
from scaletrain.plan.pipeline import bubble_ratio, p2p_factor
from scaletrain.plan.shapes import (
    attention_flops_per_token_layer,
    matmul_flops_per_token_layer,
    output_flops_per_token,
    layout_columns,
)

# elements read + written per token by one built-in block's memory-bound ops (everything but its GEMMs, attention
# kernels and views), forward and backward: counted op by op with a TorchDispatchMode on the eager block (fp32,
# 4 heads, 2 KV heads) at two widths and two FFN sizes and fitted as a x dim + b x ffn_dim; forward: norms, residual
# adds, RoPE in fp32 and SwiGLU; backward also the norms' and RoPE's gradients, SwiGLU's recomputed SiLU and its
# fp32 gradient, and the weight-gradient accumulation of the norms. tests/test_plan_formulas.py counts them again.
POINTWISE_FWD_H, POINTWISE_FWD_FFN = 34.0, 5.0
POINTWISE_BWD_H, POINTWISE_BWD_FFN = 84.5, 24.0
# the same block under autocast to bf16 (single-rank and DDP runs, train/job.py), in bytes per token, counted the same
# way (tests/test_plan_formulas.py counts them again): the embedding and the fp32 weights keep the residual stream,
# the norms and RoPE in fp32, each linear casts its fp32 input to bf16 on its own (q, k, v and w1, w3: five casts of
# the norm outputs) and the casts' backward converts their gradients back to fp32, so the block moves 2-2.5x the
# bytes of an all-bf16 block (34 x 2 = 68 bytes per dim forward). Fitted as a x dim + b x ffn_dim at two widths and
# two FFN sizes (4 heads, 2 KV heads; within 0.1 % of each count), after the weight casts below.
AUTOCAST_POINTWISE_FWD_H, AUTOCAST_POINTWISE_FWD_FFN = 180.0, 10.0
AUTOCAST_POINTWISE_BWD_H, AUTOCAST_POINTWISE_BWD_FFN = 406.0, 108.0
# autocast casts every linear's fp32 weight to bf16 once per micro-batch (its cache lives for one autocast region,
# train/step.py enters one per micro-batch) and converts the bf16 weight gradient back to fp32: read 4 + write 2
# bytes each way, per weight element of the blocks and the output layer (the embedding runs in fp32, uncast)
AUTOCAST_WEIGHT_CAST_BYTES = 12.0
# bytes per token and vocabulary entry the chunked loss (models/loss.py) moves on bf16 logits, forward + backward:
# 18 forward (the fp32 copy of the logits, log-softmax, the gather), 48 backward (both again, recomputed under its
# checkpoint, nll and log-softmax backward, the cast back to bf16, the chunks' gradients joined), counted op by op
# as step_profile counts them (tests/test_plan_formulas.py counts them again); was an unconfirmed 24
LOSS_BYTES_PER_VOCAB = 66.0
# Megatron's fused vocab-parallel cross-entropy (the GPT block's published runs) keeps the unconfirmed estimate:
# logits, their fp32 copy, log-softmax and the gradients of each
MEGATRON_LOSS_BYTES_PER_VOCAB = 24.0
# unconfirmed estimate: fp8 casts per token of one block, forward + backward, in elements: the converted linears'
# inputs (q/k/v and w1/w3 each cast their own copy of the hidden state unless sequence parallelism casts it once:
# 5h, wo's h, w2's ffn), cast again along the other axis for the weight gradient, and their output gradients
# (q 1h, k/v 2·kv, wo 1h, w1/w3 2·ffn, w2 1h); each element read twice (amax, then scale) in bf16, written in fp8
FP8_CAST_BYTES_PER_ELEMENT = 5.0
GRAD_ACCUMULATOR_BYTES = 4.0  # gradients accumulate in fp32 (FSDP2's reduce dtype, Megatron's main_grad)
# bytes per local parameter of one optimizer step (Job.step: the global gradient norm, the clip and torch's
# foreach AdamW, fp32), as bench's step_profile counts memory-bound ops (the tensors in and out of each op): counted
# on the built-in model, 64 (tests/test_plan_formulas.py counts them again). The p, g, m, v reads and p, m, v writes
# alone would be 28; foreach AdamW's intermediates (sqrt(v), its bias correction, + eps) and the clip add the rest.
ADAMW_BYTES_PER_PARAM = 64.0
# ... and what that count leaves out: an in-place foreach op returns nothing, so step_profile sees only its inputs,
# yet each writes its first list back: the weight decay, lerp_ (m), mul_ and addcmul_ (v), div_ and add_ (the sqrt
# list), addcdiv_ (p) and the clip's mul_ (g), 8 x 4 bytes per parameter. A copy bandwidth counts read + write, so
# against it a step moves 64 + 32 bytes; a CPU calibration's step bandwidth was measured in step_profile's own
# convention and keeps 64.
ADAMW_INPLACE_WRITE_BYTES = 32.0
# eager ops one block dispatches per micro-batch, (forward, backward) by activation checkpointing mode, and those of
# the embedding, final norm, output layer and loss: counted on the built-in block (tests/test_plan_formulas.py
# counts them again with a TorchDispatchMode); checkpointed blocks re-run their forward inside backward
OPS_PER_BLOCK = {"none": (88, 151), "selective": (94, 287), "full": (85, 294)}
OPS_ROOT = (17, 34)
# ATen ops torchao's Float8Linear adds to one linear in eager mode, (forward, backward) by recipe: the amax, scale
# and cast of the input, the weight and the output gradient, each its own op; counted on CPU (emulate=True) with
# count_dispatched_ops against a plain bf16 linear (tests/test_plan_formulas.py counts them again)
FP8_EAGER_OPS_PER_LINEAR = {"tensorwise": (24, 47), "rowwise": (30, 59)}
# host seconds of one of those ops over a plain op's (Cluster.op_overhead_s): each goes through the float8 tensor
# subclass's Python __torch_dispatch__. Measured, not derived: on one H200 (2026-12-04, torch 2.11, torchao 0.18)
# llama-1b mb 4 eager ran at 18,180 tokens/s with tensorwise fp8 against 36,343 without (shared/notes/gpu-h200.md);
# the host time beyond the bf16 step's, over the 112 converted linears' counted ops at 17 us each, is 2.5x
FP8_EAGER_OP_FACTOR = 2.5
# eager float8 runs every cast as separate kernels (abs, amax, scale, clamp, convert), each reading and writing the
# whole tensor: step_profile counts 66 bytes per element of a linear's input, weight and output gradient on CPU
# (emulate=True), of which ~26 are the emulation's own dequantisation before its fp32 matmul; the ~40 left are 8x
# the fused 5 (FP8_CAST_BYTES_PER_ELEMENT). unconfirmed estimate (the emulation's share is read off its code path)
FP8_EAGER_CAST_FACTOR = 8.0
LINEARS_PER_BLOCK = 7  # q, k, v, o, w1, w2, w3: what parallel/float8.py converts
# ops autocast adds to one block, (forward, backward): the five input casts and seven weight casts, and their
# backward conversions, counted as OPS_PER_BLOCK is (tests/test_plan_formulas.py); a checkpointed block casts again
# when it recomputes its forward
AUTOCAST_OPS_PER_BLOCK = (16, 22)

TIME_LINES = (
    "compute",
    "recompute",
    "op dispatch",
    "tp comm",
    "cp comm",
    "pp p2p",
    "dp comm exposed",
    "bubble",
    "optimizer",
)


def peak_flops(cluster: Cluster, precision) -> np.ndarray:
    """Dense FLOP/s per GPU for each precision code (the datasheet peak MFU is measured against)."""
    g = cluster.gpu
    rates = {"bf16": g.bf16_flops, "fp32": g.fp32_flops}
    table = np.asarray([rates[p.datasheet_rate] for p in PRECISIONS], dtype=np.float64)
    return table[np.asarray(precision)]


# rowwise-scaled fp8 matmuls run slower than tensorwise ones (torch._scaled_mm with a scale per row takes a
# CUTLASS kernel where one scale per tensor takes cuBLAS): torchtitan's Llama 3 8B on 8 x H100 with compile ran
# 6,424 tokens/s rowwise vs 7,186 tensorwise (pytorch/torchtitan commit 7a04053, Jan 2025), 0.894x; the H200
# llama-1b run of 2026-12-04 gave 0.907x (52,363 vs 57,717), which this figure was not taken from.
FP8_RECIPE_MATMUL = {"tensorwise": 1.0, "rowwise": 6_424 / 7_186}


def fp8_matmul_rate(cluster: Cluster, precision, fp8: str) -> np.ndarray:
    """Achievable FLOP/s of the blocks' matmuls: the fp8 peak x the matmul ceiling where fp8 is on, the layout is
    bf16 and the GPU has fp8 (its catalog entry); otherwise matmul_rate. A calibration measures bf16 matmuls only,
    so it scales by the datasheet's fp8/bf16 ratio. (On a CPU fp8 is emulated, in fp32: no speed-up, not modelled.)"""
    rate = matmul_rate(cluster, precision)
    g = cluster.gpu
    fp8_rate = rate * (g.fp8_flops or g.bf16_flops) / g.bf16_flops * FP8_RECIPE_MATMUL.get(fp8, 1.0)
    return np.where(fp8_layouts(cluster, precision, fp8), fp8_rate, rate)


def fp8_layouts(cluster: Cluster, precision, fp8: str) -> np.ndarray:
    """Which layouts run fp8 matmuls: fp8 on, bf16 compute, and a GPU with an fp8 rate in the catalog (others are
    refused at launch, resolve/checks.py)."""
    on = fp8 != "none" and bool(cluster.gpu.fp8_flops)
    return np.logical_and(on, np.asarray(precision) == PRECISION_NAMES.index("bf16"))


def matmul_rate(cluster: Cluster, precision) -> np.ndarray:
    """Achievable matmul FLOP/s: measured by calibration, else peak x the GPU's measured matmul ceiling."""
    if cluster.measured_matmul_flops:
        return np.full(np.shape(precision), cluster.measured_matmul_flops)
    return peak_flops(cluster, precision) * cluster.gpu.matmul_efficiency


def time_breakdown(
    work: Workload,
    grid: LayoutGrid,
    cluster: Cluster,
    cols: dict | None = None,
    options: MemoryOptions = DEFAULT_MEMORY_OPTIONS,
) -> dict[str, np.ndarray]:
    """Seconds per optimizer step for every layout, one array per line of TIME_LINES (they add up to the step).
    options.fsdp_accumulate="sharded" adds a gradient reduce-scatter to every micro-batch, not only the last."""
    args = work.args
    s = work.seq_len
    cols = cols if cols is not None else layout_columns(work, grid)
    e = np.asarray([p.element_bytes for p in PRECISIONS], dtype=np.float64)[grid.precision]
    tp, pp, cp = (x.astype(np.float64) for x in (grid.tp, grid.pp, grid.cp))
    dps, dpr = grid.dp_shard.astype(np.float64), grid.dp_replicate.astype(np.float64)
    m = grid.accumulation.astype(np.float64)

    r_mm = matmul_rate(cluster, grid.precision)
    r_block_mm = fp8_matmul_rate(cluster, grid.precision, work.fp8)
    fp8_on = fp8_layouts(cluster, grid.precision, work.fp8)
    r_attn = r_mm * cluster.gpu.attention_efficiency / cluster.gpu.matmul_efficiency
    bw = cluster.memory_bw
    tok = grid.micro_batch * s / cp  # tokens of one micro-batch on one rank (TP ranks share them)

    # autocast (bf16 or fp16 compute without FSDP, whose MixedPrecisionPolicy casts the weights itself): an fp32
    # residual stream and per-linear input casts, counted in bytes (AUTOCAST_POINTWISE_*)
    # (Megatron's GPT block keeps bf16 weights with fp32 main gradients: no autocast there)
    autocast = (e < 4.0) & ~grid.sharded & (args.block != "gpt")
    # compiled blocks fuse the casts into the kernels around them: what is left is the all-bf16 block's traffic
    fused = work.compile
    autocast_ops = autocast
    autocast = autocast & (not fused)
    point_fwd_bytes = np.where(
        autocast,
        tok * (AUTOCAST_POINTWISE_FWD_H * args.dim + AUTOCAST_POINTWISE_FWD_FFN * args.ffn_dim) / tp,
        tok * (POINTWISE_FWD_H * args.dim + POINTWISE_FWD_FFN * args.ffn_dim) * e / tp,
    )
    point_bwd_bytes = np.where(
        autocast,
        tok * (AUTOCAST_POINTWISE_BWD_H * args.dim + AUTOCAST_POINTWISE_BWD_FFN * args.ffn_dim) / tp,
        tok * (POINTWISE_BWD_H * args.dim + POINTWISE_BWD_FFN * args.ffn_dim) * e / tp,
    )
    pointwise_fwd, pointwise_bwd = point_fwd_bytes / bw, point_bwd_bytes / bw
    kv = args.n_kv_heads * args.head_dim
    cast_elements = 2.0 * (6.0 * args.dim + args.ffn_dim) + 3.0 * args.dim + 2.0 * kv + 2.0 * args.ffn_dim
    # a third of the casts in forward (the layer_fwd x 3 convention below)
    cast_bytes_per_element = FP8_CAST_BYTES_PER_ELEMENT * (1.0 if work.compile else FP8_EAGER_CAST_FACTOR)
    cast_fwd = np.where(fp8_on, tok * cast_elements * cast_bytes_per_element / 3.0 / tp / bw, 0.0)
    layer_fwd = (
        tok * matmul_flops_per_token_layer(args) / tp / r_block_mm
        + cast_fwd
        + tok * attention_flops_per_token_layer(args, work.attention_len) / tp / r_attn
        + pointwise_fwd
    )
    loss_per_vocab = MEGATRON_LOSS_BYTES_PER_VOCAB if args.block == "gpt" else LOSS_BYTES_PER_VOCAB
    loss_fwd = tok * loss_per_vocab / 3 * args.vocab_size / tp / bw  # a third of it in forward
    out_fwd = tok * output_flops_per_token(args) / tp / r_mm + loss_fwd
    # backward: twice the forward's FLOPs (and casts), and its own memory-bound ops
    layer_bwd, selective_fwd = 2.0 * (layer_fwd - pointwise_fwd) + pointwise_bwd, pointwise_fwd
    if args.block == "gpt":  # Megatron's GPT block, op by op on efficiency curves (plan/efficiency.py)
        layer_fwd, layer_bwd, selective_fwd = gpt_layer_seconds(args, tok, work.attention_len, tp, r_mm, cluster, e)
        out_fwd = gemm_seconds(tok, args.vocab_size / tp, args.dim, r_mm, cluster, e) + loss_fwd
    elif cluster.measured_matmul_curve:  # `scaletrain bench` curves: each GEMM and kernel at its measured rate
        layer_fwd, layer_bwd, selective_fwd = llama_layer_seconds(
            args, tok, work.attention_len, tp, r_mm, r_attn, (point_fwd_bytes, point_bwd_bytes), cluster, e
        )
        loss_bytes = tok * loss_per_vocab / 3 * args.vocab_size / tp
        out_fwd = gemm_seconds(tok, args.vocab_size / tp, args.dim, r_mm, cluster, e) + pointwise_seconds(
            loss_bytes, loss_bytes / 3, cluster
        )
    # the pipeline's pace is its slowest rank: the one with the output layer or the one with the most blocks
    layer = layer_fwd + layer_bwd
    body, head = cols["layers_body"] * layer, cols["layers_head"] * layer + 3.0 * out_fwd
    layers = np.where(body > head, cols["layers_body"], cols["layers_head"])  # blocks on the slowest rank
    compute_mb = np.maximum(body, head)
    recompute_mb = np.select([grid.ac == 2, grid.ac == 1], [layers * layer_fwd, layers * selective_fwd], 0.0)

    # tensor parallel (sequence parallel): per block 2 all-gathers + 2 reduce-scatters forward, as many backward,
    # 2 more for a recomputed forward; the output layer gathers once each way
    act_bytes = tok * args.dim * e
    tp_ops = layers * (8.0 + np.where(grid.ac == 2, 4.0, 0.0)) + 2.0
    tp_mb = tp_ops * collective_seconds("all_gather", act_bytes, tp, 1, cluster)
    # CPU: each of them waits for the TP ranks to arrive after the compute between two of them
    tp_spans = crosses_nodes(tp, 1.0, cluster.gpus_per_node)
    tp_wait_mb = tp_ops * amid_compute_seconds((compute_mb + recompute_mb) / tp_ops, tp, cluster, tp_spans)
    tp_mb = tp_mb + tp_wait_mb

    # context parallel, as parallel/context_parallel.py's all-gather method sends it: per block one all-gather of K
    # and V of the whole sequence (KV heads, before the GQA repeat) in forward, one reduce-scatter of their
    # gradients in backward, and with full checkpointing a second all-gather when the block's forward is recomputed
    # (selective checkpointing keeps the gathered tensors). Exposed: the attention waits for its keys.
    kv_bytes = 2.0 * grid.micro_batch * s * args.n_kv_heads * args.head_dim * e / tp
    cp_ops = 1.0 + np.where(grid.ac == 2, 1.0, 0.0)
    cp_mb = layers * (
        cp_ops * collective_seconds("all_gather", kv_bytes, cp, tp, cluster)
        + collective_seconds("reduce_scatter", kv_bytes, cp, tp, cluster)
    )

    # pipeline: activations forward and their gradients back, per micro-batch, sequence-sharded over TP
    dp_total = dps * dpr
    pp_inner = tp * cp * dp_total
    pp_mb = np.where(pp > 1, 2.0 * p2p_factor(grid.schedule) * p2p_seconds(act_bytes / tp, pp_inner, pp, cluster), 0.0)

    # data parallel: only the device's comm_overlap share of the compute can hide collectives (none on CPUs,
    # where gloo's threads and the compute share the cores)
    fwd_compute = compute_mb / 3.0 * cluster.gpu.comm_overlap
    bwd_compute = (compute_mb - compute_mb / 3.0) * cluster.gpu.comm_overlap
    # FSDP issues one collective per block and one for the root, each paying the link latency
    units = layers + 1.0

    def per_unit(kind, nbytes, size, inner):
        startup = collective_seconds(kind, 0.0, size, inner, cluster)
        return collective_seconds(kind, nbytes, size, inner, cluster) + (units - 1.0) * startup

    # FSDP shards over dp_shard x cp (cp ranks hold the same weights), tp ranks apart
    shard = dps * cp
    # tensorwise fp8 under FSDP all-gathers the blocks' linear weights in fp8: 1 byte per element instead of e
    linear_tp = cols["layers"] * matmul_flops_per_token_layer(args) / 2.0 / tp
    fp8_gather = fp8_on & (work.fp8 == "tensorwise")
    gathered_bytes = e * cols["n_tp"] - np.where(fp8_gather, (e - 1.0) * linear_tp, 0.0)
    gather = per_unit("all_gather", gathered_bytes, shard, tp)
    gather_bwd = gather * (cols["n_tp"] - cols["root_tp"]) / cols["n_tp"]  # the root stays gathered
    rs = per_unit("reduce_scatter", 4.0 * cols["n_tp"], shard, tp)
    hsdp_ar = per_unit("all_reduce", 4.0 * cols["n_tp"] / shard, dpr, tp * shard)
    fsdp = grid.sharded
    # the first gather and the last reduction wait on / for compute; the rest hides behind it as far as it can
    first_gather = gather / np.maximum(layers, 1)
    last_reduce = (rs + hsdp_ar) / np.maximum(layers, 1)
    fsdp_mb = np.where(
        fsdp,
        first_gather + np.maximum(0.0, gather - first_gather - fwd_compute) + np.maximum(0.0, gather_bwd - bwd_compute),
        0.0,
    )
    fsdp_last = np.where(
        fsdp,
        np.maximum(0.0, gather_bwd + rs + hsdp_ar - last_reduce - bwd_compute)
        - np.maximum(0.0, gather_bwd - bwd_compute)
        + last_reduce,
        0.0,
    )
    # sharded accumulation reduces every micro-batch: the other m - 1 expose what backward cannot hide
    sharded = fsdp & ~holds_unsharded_grads(fsdp, grid.pp, grid.accumulation, options.fsdp_accumulate)
    # CPU: each unit's gather waits for its group after one block's forward; in backward a gather and a reduction
    # per block share one block's backward, and HSDP's all-reduce then meets other ranks (the replicas)
    # (a group spanning nodes waits what bench --nodes measured across them)
    shard_spans = crosses_nodes(shard, tp, cluster.gpus_per_node)
    sync_fwd = amid_compute_seconds(layer_fwd, shard, cluster, shard_spans)
    sync_bwd = amid_compute_seconds(layer_bwd / 2.0, shard, cluster, shard_spans)
    replicas_span = crosses_nodes(dpr, tp * shard, cluster.gpus_per_node)
    sync_reduce = sync_bwd + amid_compute_seconds(layer_bwd / 2.0, dpr, cluster, replicas_span)
    fsdp_wait_mb = np.where(
        fsdp, units * sync_fwd + (units - 1.0) * sync_bwd + np.where(sharded, units * sync_reduce, 0.0), 0.0
    )
    fsdp_wait_last = np.where(fsdp & ~sharded, units * sync_reduce, 0.0)
    fsdp_mb, fsdp_last = fsdp_mb + fsdp_wait_mb, fsdp_last + fsdp_wait_last
    fsdp_reduce_mb = np.where(
        sharded,
        np.maximum(0.0, gather_bwd + rs + hsdp_ar - bwd_compute) - np.maximum(0.0, gather_bwd - bwd_compute),
        0.0,
    )
    # DDP all-reduces one bucket of DDP_BUCKET_CAP_BYTES at a time, each paying the latency
    buckets = np.ceil(4.0 * cols["n_tp"] / DDP_BUCKET_CAP_BYTES)
    ddp_ar = collective_seconds("all_reduce", 4.0 * cols["n_tp"], dpr, tp * cp, cluster) + (
        buckets - 1.0
    ) * collective_seconds("all_reduce", 0.0, dpr, tp * cp, cluster)
    tail = np.minimum(1.0, DDP_BUCKET_CAP_BYTES / (4.0 * cols["n_tp"]))
    # CPU: each bucket waits for the replicas after its share of the last backward
    ddp = grid.ddp
    ddp_spans = crosses_nodes(dpr, tp * cp, cluster.gpus_per_node)
    bucket_gap = (compute_mb - compute_mb / 3.0) / buckets
    ddp_wait = np.where(ddp, buckets * amid_compute_seconds(bucket_gap, dpr, cluster, ddp_spans), 0.0)
    ddp_last = np.where(ddp, np.maximum(0.0, ddp_ar * (1.0 - tail) - bwd_compute) + ddp_ar * tail, 0.0) + ddp_wait

    # gradient accumulation: every micro-batch after a step's first adds its weight gradients into the accumulated
    # ones (autograd's AccumulateGrad `grad += new`; Megatron-LM's DDP hook `main_grad.add_(grad)`, fp32): read
    # the new gradient, read and write the fp32 accumulator, per local parameter, in one kernel per weight
    accum_bytes = cols["n_local"] * (e + 2.0 * GRAD_ACCUMULATOR_BYTES)
    accum_kernel = np.minimum(accum_bytes, (e + 2.0 * GRAD_ACCUMULATOR_BYTES) * args.dim * args.ffn_dim / tp)
    accum_mb = (m - 1.0) / m * memory_seconds(accum_bytes, cluster, accum_kernel)
    # autocast's weight casts, both ways, every micro-batch: the blocks' linears and the output layer on this rank
    cast_weights = cols["layers"] * matmul_flops_per_token_layer(args) / 2.0 / tp + np.where(
        cols["layers_head"] == cols["layers"], args.dim * args.vocab_size / tp, 0.0
    )
    cast_bytes = AUTOCAST_WEIGHT_CAST_BYTES * cast_weights
    cast_mb = np.where(autocast, memory_seconds(cast_bytes, cluster, cast_bytes / np.maximum(cols["layers"], 1)), 0.0)
    compute_mb = compute_mb + accum_mb + cast_mb
    mb = compute_mb + recompute_mb + tp_mb + cp_mb + pp_mb + fsdp_mb
    # the host dispatches every op of a micro-batch: a CPU device waits for it in line, a GPU only where the
    # host falls behind the kernels (small models, small micro-batches)
    ops_fwd, ops_bwd = np.asarray([OPS_PER_BLOCK[mode] for mode in AC_MODES])[np.asarray(grid.ac)].T
    fwd_ops = layers * (ops_fwd + np.where(autocast_ops, AUTOCAST_OPS_PER_BLOCK[0], 0)) + OPS_ROOT[0]
    cast_bwd = AUTOCAST_OPS_PER_BLOCK[1] + np.where(grid.ac > 0, AUTOCAST_OPS_PER_BLOCK[0], 0)
    bwd_ops = layers * (ops_bwd + np.where(autocast_ops, cast_bwd, 0)) + OPS_ROOT[1]
    if work.fp8 in FP8_EAGER_OPS_PER_LINEAR:  # eager float8: its casts, each a (slower) subclass op
        f8_fwd, f8_bwd = (LINEARS_PER_BLOCK * FP8_EAGER_OP_FACTOR * n for n in FP8_EAGER_OPS_PER_LINEAR[work.fp8])
        recast = np.where(grid.ac > 0, f8_fwd, 0.0)  # a recomputed forward casts again
        fwd_ops = fwd_ops + np.where(fp8_on, layers * f8_fwd, 0.0)
        bwd_ops = bwd_ops + np.where(fp8_on, layers * (f8_bwd + recast), 0.0)
    host_fwd, host_bwd = fwd_ops * cluster.op_overhead_s, bwd_ops * cluster.op_overhead_s
    # a GPU runs a kernel once the host has dispatched it: where forward's kernels are shorter than their
    # dispatch, the GPU idles for the difference, and no lead from later work can give that time back; where they
    # are longer, the host's lead carries into backward. (One figure for the whole micro-batch, max(host, kernels),
    # hid forward's idle time behind backward's long GEMMs.)
    gpu_fwd = layers * layer_fwd + np.where(cols["layers_head"] == cols["layers"], out_fwd, 0.0)
    gpu_bwd = np.maximum(mb - gpu_fwd, 0.0)
    idle_fwd = np.maximum(0.0, host_fwd - gpu_fwd)
    idle_bwd = np.maximum(0.0, host_bwd - gpu_bwd - np.maximum(0.0, gpu_fwd - host_fwd))
    dispatch_mb = host_fwd + host_bwd if cluster.gpu.name == "cpu" else idle_fwd + idle_bwd
    if fused:  # compiled: Inductor's generated code launches the fused kernels, no ATen dispatch per op
        dispatch_mb = np.zeros_like(dispatch_mb)
    mb = mb + dispatch_mb
    ratio = bubble_ratio(grid.schedule, pp, m, grid.virtual_stages)
    # a CPU calibration: at the bandwidth of a real step's memory-bound ops, counted as ADAMW_BYTES_PER_PARAM is
    # the in-place writes count on a GPU only: a CPU's copy bandwidth also pays a write-allocate read of every
    # line it writes, which an in-place op's write does not, so 64 bytes at it held (docs/planner.md, Time)
    # (and only for torch's foreach AdamW: Megatron's GPT runs step with a fused Adam kernel)
    inplace = ADAMW_INPLACE_WRITE_BYTES if cluster.gpu.name != "cpu" and args.block != "gpt" else 0.0
    if cluster.measured_step_pointwise_bw:
        optimizer = ADAMW_BYTES_PER_PARAM * cols["n_local"] / cluster.measured_step_pointwise_bw
    else:
        optimizer = (ADAMW_BYTES_PER_PARAM + inplace) * cols["n_local"] / bw

    lines = {
        "compute": m * compute_mb,
        "recompute": m * recompute_mb,
        "op dispatch": m * dispatch_mb,
        "tp comm": m * tp_mb,
        "cp comm": m * cp_mb,
        "pp p2p": m * pp_mb,
        "dp comm exposed": m * fsdp_mb + (m - 1.0) * fsdp_reduce_mb + fsdp_last + ddp_last,
        "bubble": m * mb * ratio,
        "optimizer": optimizer,
    }
    # the collective waits (CPU calibrations) by line, per step
    waits = {"tp comm": m * tp_wait_mb, "dp comm exposed": m * fsdp_wait_mb + fsdp_wait_last + ddp_wait}
    return share_cores(lines, waits, pp, cluster)


def share_cores(lines: dict[str, np.ndarray], waits: dict[str, np.ndarray], pp, cluster: Cluster) -> dict:
    """The lines of a step where a CPU host's ranks outnumber its cores (a calibration's host_cores; else as given).
    They are per-rank seconds at the rates bench measured with every rank busy, each rank on cores / ranks of a
    core. A work-conserving scheduler gives a waiting rank's core to ranks with work, so a rank's step is
        step = max(lines x cores / ranks, work)
    the first term its critical path at an uncontended core's pace, the second its own work, which cannot run
    faster than its share while every rank has work. What a rank does not work is its bubble, and in a pipeline
    also the waits of its collectives (`waits`, part of their lines): its stage waits on its own group while the
    other stages, out of step in 1F1B, compute. Without a pipeline every rank runs the same program in step, and
    the measured waits already hold what the scheduler fills. The time filled comes off the bubble first, then off
    the waits. The slowest rank's work stands for every rank's: exact for balanced stages, an over-estimate
    otherwise."""
    ranks, cores = float(min(cluster.gpus, cluster.gpus_per_node)), cluster.host_cores
    if cluster.gpu.name != "cpu" or not cores or ranks <= cores:
        return lines
    piped = np.asarray(pp) > 1
    wait = np.where(piped, np.sum(list(waits.values()), axis=0), 0.0)
    total = np.sum(list(lines.values()), axis=0)
    step = np.maximum(total * cores / ranks, total - lines["bubble"] - wait)
    filled = total - step
    from_bubble = np.minimum(filled, lines["bubble"])
    share = np.where(wait > 0, (filled - from_bubble) / np.maximum(wait, 1e-30), 0.0)
    out = dict(lines, bubble=lines["bubble"] - from_bubble)
    for k, v in waits.items():
        out[k] = lines[k] - np.where(piped, share * v, 0.0)
    return out


def step_seconds(lines: dict[str, np.ndarray]) -> np.ndarray:
    return np.sum([lines[k] for k in TIME_LINES], axis=0)
