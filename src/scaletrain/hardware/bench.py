"""Measuring this host's efficiency curves: matmul FLOP/s at several GEMM shapes, copy bandwidth at several sizes,
causal attention forward + backward at several sequence lengths and head dims, host time per dispatched op, and
all-reduce / all-gather time at several message sizes between local ranks, fitted to latency + bandwidth.

Everything is measured inside the ranks a training job would run: `nproc` processes started with
torch.multiprocessing, meeting on 127.0.0.1 over torch.distributed (gloo on CPUs, NCCL with a GPU per rank), each
with the threads the local launcher gives it (launch/local.py: cores / ranks). On a CPU the ranks compute at the
same time, so the figures are what each rank gets while sharing the cores; there a real training step of the
built-in model is also timed op by op (step_profile: its GEMMs, attention and memory-bound ops, on tensors cold and
freshly allocated as in training, which the curves' short samples on warm buffers are not). Bus bandwidth follows
nccl-tests: all-reduce algbw x 2(n-1)/n, all-gather algbw x (n-1)/n.

On a CPU two more things are recorded (the planner's CPU-only terms, docs/planner.md): the cores this process may
run on (os.sched_getaffinity), and what a collective costs beyond its own time when the ranks compute between
collectives, as they do in FSDP, DDP and TP, against the gap of compute between two collectives: with more ranks
than cores, ranks reach a collective at times the scheduler's slices spread apart, and every rank waits for the last.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from scaletrain.hardware.calibration import Calibration
from scaletrain.hardware.detect import detect_host

KIB, MIB, GIB = 2**10, 2**20, 2**30
# tensor sizes the copy curve is measured at: from cache-resident to well past the last-level cache (CPU), from
# launch-bound to streaming (GPU)
COPY_BYTES = {"cpu": (64 * KIB, 1 * MIB, 16 * MIB, 64 * MIB), "cuda": (1 * MIB, 16 * MIB, 256 * MIB, GIB)}
COLLECTIVE_BYTES = (4 * KIB, 64 * KIB, 1 * MIB, 16 * MIB, 256 * MIB)  # up to the --size-mb message
# one timing sample repeats the call until it lasts this long: longer than a scheduler time slice, so that a rank
# sharing its cores sees the same share of them in a small GEMM's sample as in a large one's (as in a training step)
SAMPLE_S = 0.05
ROUNDS = 7
# compute between two collectives at which the cost of a collective amid compute is measured (CPU), as a count of
# in-cache 256^3 fp32 matmuls (~0.4 ms each on one quiet core): from a TP layer's op to an FSDP unit's backward. A
# count, not a duration: every rank must compute the same, and a duration timed on a shared host is not repeatable
# (a compute shorter than a time slice runs at a whole core's pace); the file records the gap as measured
SYNC_MATMULS = (2, 8, 32, 96)
SYNC_BYTES = 64 * KIB  # the gathered message: latency-bound, so that the extra wait is what the sample shows

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")  # timed between the ranks at each message size

# causal attention (scaled_dot_product_attention, forward + backward) measured at these (sequence length, head dim)
# points: one sequence of ATTENTION_HEADS heads on a CPU, four on a GPU
ATTENTION_POINTS = {
    "cpu": ((128, 32), (128, 128), (512, 32), (512, 128), (1024, 32)),
    "cuda": tuple((s, d) for s in (512, 2048, 8192) for d in (64, 128)),
}
ATTENTION_HEADS = 4
# the step measured op by op on a CPU (step_profile): the built-in `tiny` model on STEP_BATCH x STEP_SEQ tokens, a
# training step's activations (a few MB per tensor), STEP_REPEATS times after a warm-up
STEP_BATCH, STEP_SEQ, STEP_REPEATS = 4, 256, 3


def matmul_shapes(n: int) -> list[tuple[int, int, int]]:
    """(m, n, k) shapes measured around a large square size `n`: squares down to n/16, and skinny GEMMs (many
    tokens through a narrow layer, attention scores with a short head dim) whose intensity is low."""
    d = lambda f: max(1, n // f)  # noqa: E731
    shapes = [(n, n, n), (d(2),) * 3, (d(4),) * 3, (d(16),) * 3, (4 * n, d(8), d(8)), (4 * n, d(32), d(32))]
    # n x n/8 x n/8 and n/2 x n/2 x n/8: working sets between the squares', where a CPU's rate falls off its cache
    shapes += [(d(4), d(4), d(32)), (n, n, d(32)), (n, d(8), d(8)), (d(2), d(2), d(8))]
    return list(dict.fromkeys(shapes))


def collective_functions():
    """(all-gather, reduce-scatter) into/from one flat tensor: torch 2.13 renamed all_gather_into_tensor and
    reduce_scatter_tensor (deprecated there) to all_gather_single and reduce_scatter_single."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather, getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _median_seconds(fn, sync, inner: int, samples: int = 5) -> float:
    """Median seconds of one call of `fn` over `samples` samples of `inner` calls each, after a warm-up call; a
    collective passes the same counts on every rank."""
    fn()
    sync()
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        out.append((time.perf_counter() - t0) / inner)
    return statistics.median(out)


def _interleaved_seconds(fns, sync, barrier, agree=lambda counts: counts, rounds: int = ROUNDS) -> list[float]:
    """Median seconds of one call of each of `fns`, measured round-robin: each round takes one SAMPLE_S sample of
    every function in turn, so that load coming and going on a shared host falls on all of them alike and the
    curve keeps its shape. Every rank samples the same function at once (a barrier each): they contend as a training
    step's ranks do."""
    inner = []
    for fn in fns:  # warm-up, then the calls one sample needs
        fn()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        inner.append(int(min(100_000, max(1, SAMPLE_S / max(time.perf_counter() - t0, 1e-7)))))
    # every rank does the same calls per sample (rank 0's counts): one that timed its warm-up call alone would
    # otherwise take longer samples, finish them alone and report a whole core's rate
    inner = agree(inner)
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, n, out in zip(fns, inner, samples):
            barrier()  # every rank on the same function at once: a rank done early would leave its core to others
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            out.append((time.perf_counter() - t0) / n)
    return [statistics.median(x) for x in samples]


def _rank0_counts(port: int | None, counts: list[int]) -> list[int]:
    """Rank 0's `counts` on every rank (one process: as they are)."""
    if port is None or not counts:
        return counts
    import torch.distributed as dist

    t = torch.tensor(counts, dtype=torch.int64)
    dist.broadcast(t, 0)
    return [int(x) for x in t]


def _sync_extra_seconds(world: int, barrier, all_gather) -> list[tuple[float, float]]:
    """(gap, cost) points: seconds of compute between two collectives, and the seconds a SYNC_BYTES all-gather
    issued after that compute adds to it (run_bench subtracts what the all-gather fit charges). Every rank runs
    the same compute (SYNC_MATMULS in-cache 256^3 fp32 matmuls) and issues the gather as
    FSDP2 does (async, then wait); compute alone and compute + gather alternate, round by round."""

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    torch.mm(a, b)
    out = torch.empty(SYNC_BYTES // 4, dtype=torch.float32)
    part = out[: SYNC_BYTES // 4 // world]
    points = []
    for n_mm in SYNC_MATMULS:
        iters = max(2, 96 // n_mm)  # ~96 matmuls per sample

        def compute(n_mm=n_mm) -> None:
            for _ in range(n_mm):
                torch.mm(a, b)

        def both(compute=compute) -> None:
            compute()
            all_gather(out, part, async_op=True).wait()

        rounds: list[dict[str, float]] = []
        for _ in range(4):
            times = {}
            for kind, fn in (("c", compute), ("cg", both)):
                barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                times[kind] = (time.perf_counter() - t0) / iters
            rounds.append(times)
        # the two samples of a round met the same load on a shared host: difference within a round, median over them
        cost = statistics.median(r["cg"] - r["c"] for r in rounds)
        points.append((statistics.median(r["c"] for r in rounds), cost))
    return points


def attention_flops(seq: int, head_dim: int, heads: int = 1) -> float:
    """FLOPs of causal attention's forward + backward, by the planner's convention (plan/efficiency.py): forward
    QK^T and AV on half the s x s scores, 2 s^2 d per head; backward twice the forward."""
    return 3.0 * 2.0 * seq * seq * head_dim * heads


def attention_step(seq: int, head_dim: int, batch: int, dtype: torch.dtype, device: str):
    """Forward + backward of causal scaled_dot_product_attention on `batch` sequences of ATTENTION_HEADS heads."""
    import torch.nn.functional as F

    q, k, v = (
        torch.randn(batch, ATTENTION_HEADS, seq, head_dim, dtype=dtype, device=device, requires_grad=True)
        for _ in range(3)
    )
    grad = torch.randn(batch, ATTENTION_HEADS, seq, head_dim, dtype=dtype, device=device)

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
        q.grad = k.grad = v.grad = None

    return step


# ATen ops that move no data (views, metadata): neither timed as kernels nor counted as bytes
VIEW_OPS = frozenset(
    "view _unsafe_view reshape t transpose expand as_strided slice select unsqueeze squeeze permute detach alias "
    "split split_with_sizes unbind empty empty_like empty_strided lift_fresh _reshape_alias _fused_sdp_choice".split()
)
GEMM_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm"})


def step_profile(fn, repeats: int) -> dict:
    """One rank's kernels in `fn`, op by op (a TorchDispatchMode timing every ATen op it dispatches; a CPU runs them
    synchronously), per call of `fn`: its GEMMs by shape {(m, n, k): [FLOPs, seconds]}, its causal attention by
    shape {(seq, head_dim): [FLOPs, seconds]} (forward kernels a third of attention_flops, backward two thirds), and
    the memory-bound rest (norms, activations, RoPE, adds, the loss) as [bytes its tensors hold in and out, seconds]."""
    from torch.utils._python_dispatch import TorchDispatchMode

    gemm: dict[tuple[int, ...], list[float]] = {}
    attention: dict[tuple[int, ...], list[float]] = {}
    rest = [0.0, 0.0]

    def add(table, key, flops, dt) -> None:
        entry = table.setdefault(key, [0.0, 0.0])
        entry[0] += flops / repeats
        entry[1] += dt / repeats

    class _Timed(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            t0 = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            dt = time.perf_counter() - t0
            name = func.overloadpacket.__name__
            if name in VIEW_OPS:
                return out
            if name in GEMM_OPS:
                a, b = args[-2], args[-1]  # (bias,) a, b; batched: (batch, m, k) @ (batch, k, n)
                m, n, k = a.shape[-2], b.shape[-1], a.shape[-1]
                add(gemm, (m, n, k), 2.0 * m * n * k * (a.shape[0] if a.dim() == 3 else 1), dt)
            elif "scaled_dot_product" in name:
                q = args[0]  # forward: the query, backward: the output's gradient, both (batch, heads, seq, dim)
                share = 2.0 / 3.0 if "backward" in name else 1.0 / 3.0
                add(
                    attention,
                    (q.shape[-2], q.shape[-1]),
                    share * attention_flops(q.shape[-2], q.shape[-1], q.shape[0] * q.shape[1]),
                    dt,
                )
            else:
                tensors = [
                    t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)
                ]
                rest[0] += sum(t.numel() * t.element_size() for t in tensors) / repeats
                rest[1] += dt / repeats
            return out

    with _Timed():
        for _ in range(repeats):
            fn()
    return {"gemm": gemm, "attention": attention, "pointwise": rest}


def count_dispatched_ops(fn) -> int:
    """Number of ATen ops `fn()` dispatches (forward and autograd's backward alike), counted by a
    TorchDispatchMode."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    with _Count() as counter:
        fn()
    return counter.n


def tiny_model_step(device: str = "cpu", batch: int = 1, seq: int = 8):
    """(step, ops): forward + backward of the built-in `tiny` model on batch x seq tokens, and the ops it
    dispatches. On 8 tokens the kernels are too small to matter: its seconds / ops is the host time per dispatched
    op (the planner's OPS_PER_BLOCK count)."""
    import torch.nn.functional as F

    from scaletrain.models import preset_spec

    spec = preset_spec("tiny")
    model = spec.build("meta").to_empty(device=device)
    spec.init_weights(model, seed=0)
    tokens = torch.randint(0, spec.args.vocab_size, (batch, seq), device=device)

    def step() -> None:
        logits = model(tokens)
        F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten(), reduction="sum").backward()
        model.zero_grad(set_to_none=True)

    return step, count_dispatched_ops(step)


@dataclass(frozen=True)
class BenchPlan:
    matmul_n: int
    dtype: torch.dtype
    collective_bytes: tuple[int, ...]
    backend: str  # gloo or nccl (collectives)
    gpu_compute: bool  # compute on a GPU (rank r on cuda:r, or only rank 0 on cuda:0 when GPUs are fewer)
    compute: bool = True  # measure the compute curves (False: collectives only, for `scaletrain doctor`)


def _measure(rank: int, world: int, port: int | None, plan: BenchPlan, out) -> None:
    """One rank: its compute curves, then the collectives; rank r puts (r, results) on `out`."""
    import torch.distributed as dist

    if not plan.gpu_compute:  # the local launcher's rule (launch/local.py): the cores shared among the ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if port is not None:
        dist.init_process_group(plan.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    nccl = plan.backend == "nccl"
    device = f"cuda:{rank}" if nccl else ("cuda:0" if plan.gpu_compute else "cpu")
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    barrier = dist.barrier if port is not None else (lambda: None)
    computes = plan.compute and (not plan.gpu_compute or nccl or rank == 0)
    res: dict[str, list] = {
        "matmul": [],
        "copy": [],
        "attention": [],
        "op": [],
        "all_reduce": [],
        "all_gather": [],
        "reduce_scatter": [],
        "sync": [],
        "step": [],
    }
    try:
        device_kind = "cuda" if plan.gpu_compute else "cpu"
        shapes = matmul_shapes(plan.matmul_n) if computes else []
        sizes = COPY_BYTES[device_kind] if computes else ()
        attention = ATTENTION_POINTS[device_kind] if computes else ()
        attention_batch = 1 if device_kind == "cpu" else 4
        fns, ops = [], 1
        for m, n, k in shapes:
            a = torch.randn(m, k, dtype=plan.dtype, device=device)
            fns.append(partial(torch.mm, a, torch.randn(k, n, dtype=plan.dtype, device=device)))
        for nbytes in sizes:
            src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
            fns.append(partial(torch.empty_like(src).copy_, src))
        for seq, head_dim in attention:
            fns.append(attention_step(seq, head_dim, attention_batch, plan.dtype, device))
        if computes:
            step, ops = tiny_model_step(device)
            fns.append(step)
        every = not plan.gpu_compute or nccl  # every rank computes (else rank 0 alone, on the one GPU)
        agree = partial(_rank0_counts, port if every else None)
        seconds = _interleaved_seconds(fns, sync, barrier, agree) if plan.compute else []
        res["matmul"] = [(m, n, k, 2.0 * m * n * k / t) for (m, n, k), t in zip(shapes, seconds)]
        res["copy"] = [(b, 2.0 * b / t) for b, t in zip(sizes, seconds[len(shapes) :])]
        at = seconds[len(shapes) + len(sizes) :]
        res["attention"] = [
            (s, d, attention_flops(s, d, attention_batch * ATTENTION_HEADS) / t) for (s, d), t in zip(attention, at)
        ]
        res["op"] = [t / ops for t in seconds[len(shapes) + len(sizes) + len(attention) :]]
        if computes and device_kind == "cpu":  # a real step op by op (a GPU would need a sync around every op)
            step, _ = tiny_model_step(device, STEP_BATCH, STEP_SEQ)
            step()
            barrier()  # every rank at once, sharing the cores as in training
            res["step"] = [step_profile(step, STEP_REPEATS)]
        if port is not None:
            cdev = device if nccl else "cpu"
            gather, scatter = collective_functions()
            for nbytes in plan.collective_bytes:
                t = torch.ones(nbytes // 4, dtype=torch.float32, device=cdev)
                gathered = torch.empty(world * (nbytes // 4 // world), dtype=torch.float32, device=cdev)
                part = t[: nbytes // 4 // world]
                for kind, fn in (
                    ("all_reduce", partial(dist.all_reduce, t)),
                    ("all_gather", partial(gather, gathered, part)),
                    ("reduce_scatter", partial(scatter, torch.empty_like(part), gathered)),
                ):
                    barrier()
                    inner = min(5, max(1, 64 * KIB // nbytes))  # the same count on every rank
                    slowest = torch.tensor([_median_seconds(fn, sync, inner)], dtype=torch.float64).to(cdev)
                    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a collective ends with its slowest rank
                    size = nbytes if kind == "all_reduce" else gathered.numel() * 4
                    res[kind].append((size, float(slowest.cpu())))
            if plan.compute and not plan.gpu_compute:
                res["sync"] = _sync_extra_seconds(world, barrier, gather)
        out.put((rank, res))
    finally:
        if port is not None:
            dist.destroy_process_group()


def _usable_cores() -> int:
    """CPUs this process may run on (its affinity mask: a container's or taskset's limit, not the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(nproc: int, plan: BenchPlan) -> list[dict]:
    """Run _measure in `nproc` fresh local processes (one in this process when nproc is 1); results by rank.
    Without a GPU they are forked: they inherit torch and the caller's modules instead of importing them again
    (on 2 busy cores, 4 spawned ranks took 35 s to start); CUDA cannot be forked, so with a GPU they are spawned."""
    import torch.multiprocessing as mp

    method = "spawn" if plan.gpu_compute or plan.backend == "nccl" else "fork"
    if method == "fork" and plan.compute:  # the first steps of a model pay one-time set-up: pay it once, here
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # no OpenMP thread pool in the parent: libgomp's is not safe to fork
        try:
            step, _ = tiny_model_step()
            step()
        finally:
            torch.set_num_threads(threads)
    ctx = mp.get_context(method)
    out = ctx.SimpleQueue()
    if nproc == 1:
        _measure(0, 1, None, plan, out)
    else:
        mp.start_processes(
            _measure, args=(nproc, _free_port(), plan, out), nprocs=nproc, join=True, start_method=method
        )
    results = dict(out.get() for _ in range(nproc))
    return [results[r] for r in range(nproc)]


def ring_terms(kind: str, n: float) -> tuple[float, float]:
    """(ring steps, volume factor) of a ring collective over `n` ranks, t = steps x latency + volume x bytes / busbw
    (nccl-tests' bus bandwidth): an all-reduce twice an all-gather's, a reduce-scatter an all-gather's."""
    factor = 2.0 if kind == "all_reduce" else 1.0
    return factor * (n - 1), factor * (n - 1) / n


def sync_extras(points, allgather_fit, n: float) -> tuple[tuple[float, float], ...]:
    """The waits amid compute a calibration keeps: each (gap, cost) point's cost beyond what the all-gather fit
    (latency per ring step, bus bandwidth; None: not measured) charges for SYNC_BYTES over `n` ranks, since the
    planner charges both; kept positive (calibration files)."""
    lat, busbw = allgather_fit
    steps, volume = ring_terms("all_gather", n)
    alone = steps * (lat or 0.0) + volume * SYNC_BYTES / (busbw or math.inf)
    return tuple((gap, max(cost - alone, 1e-9)) for gap, cost in points)


def fit_latency_bandwidth(points, steps: float, volume: float) -> tuple[float, float]:
    """(latency per ring step in s, bus bandwidth in bytes/s) of t = steps x latency + volume x bytes / busbw,
    least squares on the relative error over measured (bytes, seconds) points (small messages weigh as much as
    large ones). A negative latency fit (noise) falls back to a bandwidth-only fit."""
    size = np.asarray([p[0] for p in points], dtype=np.float64)
    sec = np.asarray([p[1] for p in points], dtype=np.float64)
    coef, *_ = np.linalg.lstsq(np.stack([1.0 / sec, size / sec], axis=1), np.ones_like(sec), rcond=None)
    a, b = float(coef[0]), float(coef[1])
    if a < 0 or b <= 0:
        a, b = 0.0, float(np.sum(size / sec) / np.sum((size / sec) ** 2))
    return a / steps, volume / b


def measure_allreduce_busbw(nproc: int = 2, nbytes: int = 16 * MIB) -> float:
    """All-reduce bus bandwidth between `nproc` local ranks at one message size, bytes/s (algbw x 2(n-1)/n)."""
    fields = _collectives(nproc, (nbytes,))
    return 2.0 * (nproc - 1) / nproc * nbytes / fields["all_reduce"][0][1]


def _backend(nproc: int) -> str:
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nproc else "gloo"


def _collectives(nproc: int, sizes: tuple[int, ...]) -> dict:
    plan = BenchPlan(16, torch.float32, sizes, _backend(nproc), torch.cuda.is_available(), compute=False)
    return _spawn(nproc, plan)[0]


def run_bench(nproc: int = 2, matmul_n: int | None = None, collective_bytes: int = 16 * MIB) -> Calibration:
    """Measure this host's curves over `nproc` local ranks and return its calibration (GPU: bf16 matmuls;
    CPU: fp32). matmul_n: the largest square GEMM (default 1024 on a CPU, 8192 on a GPU); collectives at
    COLLECTIVE_BYTES up to `collective_bytes` (none with one rank)."""
    host = detect_host()
    on_gpu = host.gpu_count > 0
    sizes = tuple(sorted({b for b in COLLECTIVE_BYTES if b < collective_bytes} | {collective_bytes}))
    plan = BenchPlan(
        matmul_n or (8192 if on_gpu else 1024),
        torch.bfloat16 if on_gpu else torch.float32,
        sizes if nproc > 1 else (),
        _backend(nproc),
        on_gpu,
    )
    results = _spawn(nproc, plan)
    ranks = [r for r in results if r["matmul"]]  # the ranks that computed

    def mean_curve(name: str, keys: int) -> tuple[tuple[float, ...], ...]:
        # each point: the shape, and the mean over the computing ranks of what each got
        return tuple((*pts[0][:keys], statistics.fmean(p[keys] for p in pts)) for pts in zip(*(r[name] for r in ranks)))

    matmul, copy, attention = mean_curve("matmul", 3), mean_curve("copy", 1), mean_curve("attention", 2)
    step = _step_figures([r["step"][0] for r in ranks if r["step"]])
    fits: dict[str, tuple[float, float] | tuple[None, None]] = dict.fromkeys(COLLECTIVES, (None, None))
    if nproc > 1:
        for kind in COLLECTIVES:
            fits[kind] = fit_latency_bandwidth(results[0][kind], *ring_terms(kind, nproc))
    sync = sync_extras(results[0]["sync"], fits["all_gather"], nproc)
    return Calibration(
        device=host.catalog_gpu,
        host=host.hostname,
        ranks=nproc,
        matmul_flops=max(p[3] for p in matmul),
        matmul_dtype=str(plan.dtype).removeprefix("torch."),
        memory_bw=copy[-1][1],
        allreduce_busbw=fits["all_reduce"][1],
        memory_bytes=float(host.gpu_memory_bytes[0]) if on_gpu else host.memory_bytes,
        torch_version=torch.__version__,
        op_overhead_s=statistics.fmean(r["op"][0] for r in ranks),
        allreduce_latency_s=fits["all_reduce"][0],
        allgather_busbw=fits["all_gather"][1],
        allgather_latency_s=fits["all_gather"][0],
        reducescatter_busbw=fits["reduce_scatter"][1],
        reducescatter_latency_s=fits["reduce_scatter"][0],
        matmul=matmul,
        copy=copy,
        all_reduce=tuple(results[0]["all_reduce"]),
        all_gather=tuple(results[0]["all_gather"]),
        reduce_scatter=tuple(results[0]["reduce_scatter"]),
        host_cores=None if on_gpu else _usable_cores(),
        collective_amid_compute=sync,
        attention=attention,
        **step,
    )


def _step_figures(profiles: list[dict]) -> dict:
    """Calibration fields from each rank's step_profile (the mean over ranks): in-step GEMM rates by shape, in-step
    attention rates, and the bandwidth of the memory-bound rest. None measured: no fields."""
    if not profiles:
        return {}

    def rates(name: str) -> tuple[tuple[float, ...], ...]:
        return tuple(
            (*key, statistics.fmean(p[name][key][0] / p[name][key][1] for p in profiles))
            for key in sorted(profiles[0][name])
        )

    nbytes, seconds = (statistics.fmean(p["pointwise"][i] for p in profiles) for i in (0, 1))
    return {
        "step_matmul": rates("gemm"),
        "step_attention": rates("attention"),
        "step_pointwise_bw": nbytes / seconds if seconds > 0 else None,
    }
