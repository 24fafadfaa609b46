"""Efficiency curves instead of single peak factors: how fast a GEMM of a given shape, a memory-bound kernel of a
given size and a block of Megatron's GPT model run on a GPU, each curve with its source.

- GEMMs: tile and wave quantization (NVIDIA, "Matrix Multiplication Background User's Guide", DU-09799-001, 2023,
  §2.3 and §3 [R]): cuBLAS splits the output into thread-block tiles, each SM computes one tile at a time, so a
  GEMM takes ceil(tiles / SMs) waves and a partial tile or a partial wave costs a whole one. Small and skinny
  GEMMs (few tiles, short k) therefore run far below the large-GEMM ceiling (GPUSpec.matmul_efficiency). A GEMM
  that moves more bytes than it can compute on is memory-bound (the roofline, Williams et al. 2009).
- Memory-bound kernels (norms, bias + activation, dropout, softmax, the optimizer): bytes at the achieved share of
  the memory bandwidth for their size (MEMORY_SIZE_EFFICIENCY).
- Collectives: latency + bandwidth per ring step (plan/comm.py), so small messages pay mostly latency.
- Host overhead per op: plan/steptime.py (OPS_PER_BLOCK x Cluster.op_overhead_s).

`scaletrain bench` measures these curves on the host it runs on (hardware/bench.py): matmul FLOP/s at several GEMM
shapes, copy bandwidth at several sizes, collective latency + bandwidth, per-op overhead. With a calibration the
measured points replace the modelled curves: a GEMM runs at the rate measured for its intensity (FLOPs per element
moved), a memory-bound kernel at the bandwidth measured for its size, both interpolated in log space between the
measured points and held flat beyond them (measured_curve).

On a CPU (a calibration with the host's cores) two things differ, both measured by bench (docs/planner.md):
- a GEMM's rate follows its working set as much as its intensity: fp32 GEMMs whose operands fit the per-core
  cache run several times faster than those that do not (this host, one thread: 256 x 128 x 352 at 97 GFLOP/s,
  1024 x 128 x 352 at 23), so the rate is interpolated between the measured shapes nearest in (log working set,
  log intensity) (shape_rate);
- a collective issued between computations waits for the last rank to arrive (amid_compute_seconds).
"""

from __future__ import annotations

import functools

import numpy as np

from scaletrain.hardware.cluster import Cluster

# Streaming multiprocessors per GPU: each runs one GEMM tile at a time (wave quantization). NVIDIA A100 Tensor Core
# GPU Architecture whitepaper (108 SMs) [T]; H100 whitepaper (132 SMs SXM5, 114 PCIe) [T]; H200 = H100 SXM die [T];
# B200 148 [T, unconfirmed]; L40S 142, RTX 4090 128 (Ada whitepaper) [T]. A CPU has no waves: None.
SM_COUNT: dict[str, int] = {
    "a100-80gb": 108,
    "a100-40gb": 108,
    "h100-sxm": 132,
    "h100-pcie": 114,
    "h200": 132,
    "b200": 148,
    "l40s": 142,
    "rtx-4090": 128,
}
# (tile rows, tile columns, throughput of one SM on this tile relative to the largest): the guide's §2.3 lists
# 256x128 as the most efficient cuBLAS tile and smaller tiles as less efficient "since they reuse less data";
# the 0.85 / 0.65 factors are unconfirmed estimates (the guide shows the trend, not a figure). cuBLAS's heuristics
# choose a tile per shape: the fastest of these is taken.
GEMM_TILES = ((256, 128, 1.0), (128, 128, 0.85), (128, 64, 0.65))
# Achieved share of the memory bandwidth by bytes a kernel moves: Calculon (Isaev et al., SC'23) artifact,
# calculon-ai/calculon systems/a100_80g.json "mem1" MB_efficiency [R]: >= 100 MB 0.90, >= 10 MB 0.75, >= 1 MB 0.60,
# else 0.30. (Calculon fitted its curves to the same Megatron runs benchmarks/planner_published.py checks against,
# so that check is not independent of this curve; the held-out table is.)
MEMORY_SIZE_EFFICIENCY = ((100e6, 0.90), (10e6, 0.75), (1e6, 0.60), (0.0, 0.30))


def measured_curve(x, points):
    """y at `x` on a measured curve of (x, y) points: linear in log x / log y between them, flat beyond the ends
    (no extrapolation past what was measured); points at the same x are averaged (geometrically)."""
    xs = sorted({px for px, _ in points})
    ys = [np.mean([np.log(py) for px, py in points if px == x0]) for x0 in xs]
    return np.exp(np.interp(np.log(np.asarray(x, dtype=np.float64)), np.log(xs), ys))


def memory_seconds(nbytes, cluster: Cluster, per_kernel_bytes=None):
    """Seconds to stream `nbytes` through device memory in kernels of `per_kernel_bytes` each (default: one kernel)
    at the achieved bandwidth for that size; a calibrated (measured) bandwidth is used as measured."""
    nbytes = np.asarray(nbytes, dtype=np.float64)
    if cluster.measured_copy_curve:
        size = nbytes if per_kernel_bytes is None else np.asarray(per_kernel_bytes, dtype=np.float64)
        return nbytes / measured_curve(np.maximum(size, 1.0), cluster.measured_copy_curve)
    if cluster.measured_memory_bw or cluster.gpu.name not in SM_COUNT:
        return nbytes / cluster.memory_bw
    size = nbytes if per_kernel_bytes is None else np.asarray(per_kernel_bytes, dtype=np.float64)
    eff = np.full(np.shape(size), MEMORY_SIZE_EFFICIENCY[-1][1])
    for threshold, value in reversed(MEMORY_SIZE_EFFICIENCY[:-1]):
        eff = np.where(size >= threshold, value, eff)
    return nbytes / (cluster.memory_bw * eff)


def nearest_rates(query, points, rates) -> np.ndarray:
    """Rates at `query` features from measured `points` (same features, last axis) and their `rates`: inverse-
    square-distance weights in feature space, geometric mean of the rates (a measured point gets its own rate;
    never outside the measured range)."""
    q = np.stack([np.asarray(x, dtype=np.float64) for x in query], axis=-1)
    p = np.asarray(points, dtype=np.float64)
    d2 = np.sum((q[..., None, :] - p) ** 2, axis=-1)
    w = 1.0 / np.maximum(d2, 1e-12)
    return np.exp(np.sum(w * np.log(np.asarray(rates, dtype=np.float64)), axis=-1) / np.sum(w, axis=-1))


def gemm_features(m, n, k):
    ws = m * k + k * n + m * n
    return np.log(ws), np.log(2.0 * m * n * k / ws)


def shape_rate(m, n, k, shapes) -> np.ndarray:
    """FLOP/s of [m x k] @ [k x n] GEMMs from measured (m, n, k, FLOP/s) shapes, nearest in (log working set
    mk + kn + mn, log intensity) space (nearest_rates)."""
    m, n, k = (np.asarray(x, dtype=np.float64) for x in (m, n, k))
    pts = np.asarray(shapes, dtype=np.float64)
    return nearest_rates(gemm_features(m, n, k), np.stack(gemm_features(*pts[:, :3].T), axis=-1), pts[:, 3])


def attention_rate(seq, head_dim, points) -> np.ndarray:
    """FLOP/s of causal attention forward + backward from measured (seq, head dim, FLOP/s) points, nearest in
    (log seq, log head dim) space (nearest_rates)."""
    pts = np.asarray(points, dtype=np.float64)
    return nearest_rates((np.log(seq), np.log(head_dim)), np.log(pts[:, :2]), pts[:, 2])


def in_step_factors(cluster: Cluster) -> tuple[float, float]:
    """(GEMM, attention) seconds a real training step measured (bench's step_profile, CPU) over what the curves
    give for the same GEMMs and attention: cold operands, fresh outputs and the cores shared over a whole step,
    which the curves' short, cache-warm samples do not see. 1.0 where not measured."""
    return _in_step_factors(
        cluster.measured_step_matmul,
        cluster.measured_matmul_shapes,
        cluster.measured_step_attention,
        cluster.measured_attention,
    )


@functools.lru_cache(maxsize=16)
def _in_step_factors(step, shapes, step_attention, attention) -> tuple[float, float]:
    """in_step_factors from the measured points themselves (tuples): computed once per calibration, not once per
    GEMM priced."""
    mm, att = 1.0, 1.0
    if step and shapes:
        pts = np.asarray(step, dtype=np.float64)
        flops = 2.0 * pts[:, 0] * pts[:, 1] * pts[:, 2]
        mm = float(np.sum(flops / pts[:, 3]) / np.sum(flops / shape_rate(pts[:, 0], pts[:, 1], pts[:, 2], shapes)))
    if step_attention and attention:
        pts = np.asarray(step_attention, dtype=np.float64)
        flops = pts[:, 0] ** 2 * pts[:, 1]  # the per-head FLOPs' shape; the constant cancels
        curve = attention_rate(pts[:, 0], pts[:, 1], attention)
        att = float(np.sum(flops / pts[:, 2]) / np.sum(flops / curve))
    return mm, att


def attention_seconds(seq, head_dim, heads, cluster: Cluster):
    """(forward, backward) seconds of causal attention on `heads` (sequences x local heads) of `seq` x `head_dim`
    at the rate bench measured for that shape (None without a measured curve): 3 x the forward's 2 s^2 d FLOPs per
    head, a third of the time in forward, scaled by the in-step attention factor on a CPU."""
    if not cluster.measured_attention:
        return None
    flops = 6.0 * np.asarray(seq, dtype=np.float64) ** 2 * head_dim * np.asarray(heads, dtype=np.float64)
    total = flops / attention_rate(seq, head_dim, cluster.measured_attention) * in_step_factors(cluster)[1]
    return total / 3.0, 2.0 * total / 3.0


def nondecreasing(ys) -> list[float]:
    """The least-squares non-decreasing fit of `ys` (pool adjacent violators, Ayer et al. 1955)."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([float(y), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


def amid_compute_seconds(gap, size, cluster: Cluster, spans_nodes=False):
    """Extra seconds one collective on `size` ranks waits when the ranks computed for `gap` seconds since the last
    one: a CPU calibration's measured curve (0 without one, or for one rank). It is the wait for the last rank to
    arrive, taken as the same for any group (bench measures it over all its ranks). The spread of arrivals builds
    up over the compute between two collectives, so the measured points are read through their non-decreasing
    fit (a loaded host scatters them); linear between the measured gaps and through zero (no compute in between,
    no spread), flat beyond the largest. A group that `spans_nodes` (an array or bool) waits what bench --nodes
    measured over every rank of every node, where it did (else the curve inside a node)."""
    size = np.asarray(size, dtype=np.float64)

    def read(curve):
        if not curve:
            return np.zeros(np.broadcast(np.asarray(gap), size).shape)
        xs, ys = zip(*sorted(curve))
        return np.interp(np.asarray(gap, dtype=np.float64), (0.0, *xs), (0.0, *nondecreasing(ys)))

    wait = read(cluster.measured_sync_curve)
    if cluster.measured_inter_sync_curve:
        wait = np.where(spans_nodes, read(cluster.measured_inter_sync_curve), wait)
    return np.where(size > 1.0, wait, 0.0)


def gemm_seconds(m, n, k, rate, cluster: Cluster, elem_bytes, batch=1.0):
    """Seconds of `batch` GEMMs of [m x k] @ [k x n] at a large-GEMM rate of `rate` FLOP/s: tile and wave
    quantization over the GPU's SMs (none on a CPU), and never faster than its bytes at memory bandwidth. With a
    measured matmul curve: at `rate` x the curve's rate for this GEMM's intensity / its best measured rate."""
    m, n, k, batch = (np.asarray(x, dtype=np.float64) for x in (m, n, k, batch))
    rate = np.asarray(rate, dtype=np.float64)
    flops = 2.0 * m * n * k * batch
    curve = cluster.measured_matmul_curve
    if cluster.measured_matmul_shapes:  # a CPU: by working set and intensity (shape_rate), as in a real step
        shapes = cluster.measured_matmul_shapes
        best = max(p[3] for p in shapes)
        return flops / (rate * shape_rate(m, n, k, shapes) / best) * in_step_factors(cluster)[0]
    if curve:  # the measurement holds the tiles, waves, caches and memory traffic this shape meets
        best = max(y for _, y in curve)
        return flops / (rate * measured_curve(2.0 * m * n * k / (m * k + k * n + m * n), curve) / best)
    sms = SM_COUNT.get(cluster.gpu.name)
    if sms is None or cluster.measured_matmul_flops:
        compute = flops / rate
    else:
        compute = np.full(np.broadcast(m, n, k, batch, rate).shape, np.inf)
        for tm, tn, rel in GEMM_TILES:
            tiles = batch * np.ceil(m / tm) * np.ceil(n / tn)
            waves = np.ceil(tiles / sms)
            compute = np.minimum(compute, waves * 2.0 * tm * tn * k / (rate * rel / sms))
    moved = elem_bytes * batch * (m * k + k * n + m * n)
    return np.maximum(compute, memory_seconds(moved, cluster))


def linear_seconds(tokens, n_in, n_out, rate, cluster: Cluster, elem_bytes):
    """(forward, backward) seconds of a linear layer on `tokens` rows: Y = XW, then dX = dY W^T and dW = X^T dY."""
    fwd = gemm_seconds(tokens, n_out, n_in, rate, cluster, elem_bytes)
    bwd = gemm_seconds(tokens, n_in, n_out, rate, cluster, elem_bytes) + gemm_seconds(
        n_in, n_out, tokens, rate, cluster, elem_bytes
    )
    return fwd, bwd


# Megatron's GPT block (Korthikanti et al. 2022, their Figure/Table 2 tensors) moves per token in forward, in
# elements of the activation dtype: LayerNorm in + out 2h twice, bias + dropout + residual add (reads 2h, writes h,
# a 1-byte mask h) twice, bias + GELU on the MLP's 4h (read, write); per head and key position: the fused
# scale-mask-softmax reads and writes the scores, dropout reads them and writes its output and a 1-byte mask.
GPT_POINTWISE_ELEMENTS_H = 2.0 * 2 + 2 * 3.0  # LayerNorms, bias-dropout-adds (masks counted in bytes below)
GPT_MASK_BYTES_H = 2.0  # the two residual dropout masks, one byte per element
GPT_GELU_ELEMENTS_F = 2.0  # bias + GELU: read and write the ffn_dim activation
GPT_SCORE_ELEMENTS = 4.0  # softmax read + write, dropout read + write, per head per key position
GPT_SCORE_MASK_BYTES = 1.0


def gpt_layer_seconds(args, tokens, seq_len, tp, rate, cluster: Cluster, elem_bytes):
    """(forward, backward, attention core forward) seconds of one Megatron GPT block on one tensor-parallel rank,
    for `tokens` = micro-batch x sequence tokens. The attention core (QK^T, softmax, dropout, AV) is what
    selective recomputation re-runs (Korthikanti et al. 2022, §5). Sequence parallelism: LayerNorms and dropouts
    run on tokens / tp."""
    h, f, a, d = float(args.dim), float(args.ffn_dim), float(args.n_heads), float(args.head_dim)
    tp = np.asarray(tp, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.float64)
    e = np.asarray(elem_bytes, dtype=np.float64)
    fwd = np.zeros(np.broadcast(tokens, tp, e).shape)
    bwd = np.zeros_like(fwd)
    for n_in, n_out in ((h, 3.0 * h / tp), (h / tp, h), (h, f / tp), (f / tp, h)):
        lf, lb = linear_seconds(tokens, n_in, n_out, rate, cluster, e)
        fwd, bwd = fwd + lf, bwd + lb
    # attention core: batched over (sequences x local heads); scores s x s
    seqs = tokens / seq_len
    heads = seqs * a / tp
    s = float(seq_len)
    qk = gemm_seconds(s, s, d, rate, cluster, e, heads)
    av = gemm_seconds(s, d, s, rate, cluster, e, heads)
    score_bytes = heads * s * s * (GPT_SCORE_ELEMENTS * e + GPT_SCORE_MASK_BYTES)
    core_fwd = qk + av + memory_seconds(score_bytes, cluster, score_bytes / 2)
    # backward of QK^T and AV: two GEMMs each; softmax and dropout backward move about twice the bytes
    core_bwd = 2.0 * (qk + av) + memory_seconds(2.0 * score_bytes, cluster, score_bytes / 2)
    point_bytes = tokens / tp * (e * (GPT_POINTWISE_ELEMENTS_H * h) + GPT_MASK_BYTES_H * h) + tokens * (
        e * GPT_GELU_ELEMENTS_F * f / tp
    )
    point = memory_seconds(point_bytes, cluster, point_bytes / 6)  # ~6 kernels per block forward
    return fwd + core_fwd + point, bwd + core_bwd + 2.0 * point, core_fwd


# Bytes one pointwise kernel of the Llama block moves, in activations of tokens x dim: a binary op (residual add,
# RoPE's multiply, gating) reads two and writes one. unconfirmed estimate: the block's kernels vary around it.
LLAMA_KERNEL_ACTIVATIONS = 3.0


def pointwise_seconds(nbytes, kernel_bytes, cluster: Cluster):
    """Seconds of memory-bound kernels moving `nbytes` in kernels of `kernel_bytes`: at the bandwidth bench
    measured for them inside a real step (a CPU calibration), else at the copy curve's for their size."""
    if cluster.measured_step_pointwise_bw:
        return np.asarray(nbytes, dtype=np.float64) / cluster.measured_step_pointwise_bw
    return memory_seconds(nbytes, cluster, kernel_bytes)


def llama_layer_seconds(args, tokens, seq_len, tp, rate, attn_rate, pointwise_bytes, cluster: Cluster, elem_bytes):
    """(forward, backward, pointwise forward) seconds of one Llama block on one tensor-parallel rank for `tokens`
    tokens, each GEMM at the rate measured for its shape (a calibrated cluster): q/k/v/o, gate/up/down, and the
    attention core at the measured attention curve's rate (else as (sequences x local heads) GEMMs of s x s x
    head_dim at `attn_rate`; causal: half the square, plan/shapes.py); pointwise ops stream `pointwise_bytes`
    (forward, backward) in kernels of LLAMA_KERNEL_ACTIVATIONS activations. Backward: the two GEMMs of each
    linear, twice the attention core."""
    h, f, d = float(args.dim), float(args.ffn_dim), float(args.head_dim)
    q, kv = args.n_heads * d, args.n_kv_heads * d
    tp = np.asarray(tp, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.float64)
    e = np.asarray(elem_bytes, dtype=np.float64)
    fwd = np.zeros(np.broadcast(tokens, tp, e).shape)
    bwd = np.zeros_like(fwd)
    for n_in, n_out in ((h, q / tp), (h, kv / tp), (h, kv / tp), (q / tp, h), (h, f / tp), (h, f / tp), (f / tp, h)):
        lf, lb = linear_seconds(tokens, n_in, n_out, rate, cluster, e)
        fwd, bwd = fwd + lf, bwd + lb
    heads = tokens / seq_len * args.n_heads / tp
    s = float(seq_len)
    measured = attention_seconds(s, d, heads, cluster)
    if measured is not None:
        core_fwd, core_bwd = measured
    else:
        core_fwd = 0.5 * (
            gemm_seconds(s, s, d, attn_rate, cluster, e, heads) + gemm_seconds(s, d, s, attn_rate, cluster, e, heads)
        )
        core_bwd = 2.0 * core_fwd
    kernel = LLAMA_KERNEL_ACTIVATIONS * tokens * h * e / tp
    point_fwd, point_bwd = (pointwise_seconds(b, kernel, cluster) for b in pointwise_bytes)
    return fwd + core_fwd + point_fwd, bwd + core_bwd + point_bwd, point_fwd
