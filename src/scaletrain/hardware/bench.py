"""Measuring this host's efficiency curves: matmul FLOP/s at several GEMM shapes, copy bandwidth at several sizes,
causal attention forward + backward at several sequence lengths and head dims, host time per dispatched op, and
all-reduce / all-gather time at several message sizes between local ranks, fitted to latency + bandwidth.

Everything is measured inside the ranks a training job would run: `nproc` local processes (started by
launch/bench_local.py), meeting on 127.0.0.1 over torch.distributed (gloo on CPUs, NCCL with a GPU per rank), each
with the threads the local launcher gives it (launch/local.py: cores / ranks). On a CPU the ranks compute at the
same time, so the figures are what each rank gets while sharing the cores; there a real training step of the
built-in model is also timed op by op (step_profile: its GEMMs, attention and memory-bound ops, on tensors cold and
freshly allocated as in training, which the curves' short samples on warm buffers are not). Bus bandwidth follows
nccl-tests: all-reduce algbw x 2(n-1)/n, all-gather algbw x (n-1)/n.

On a CPU two more things are recorded (the planner's CPU-only terms, docs/planner.md): the cores this process may
run on (os.sched_getaffinity), and what a collective costs beyond its own time when the ranks compute between
collectives, as they do in FSDP, DDP and TP, against the gap of compute between two collectives: with more ranks
than cores, ranks reach a collective at times the scheduler's slices spread apart, and every rank waits for the last.

This module is one rank's measurement (measure_rank) and the calibration made of every rank's (calibration_from);
the work it times is in kernels.py, how it times it in timing.py and op_profile.py, the fits in fit.py.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from functools import partial

import torch

from scaletrain.hardware.calibration import Calibration
from scaletrain.hardware.detect import HostInfo
from scaletrain.hardware.fit import fit_latency_bandwidth, ring_terms, step_figures, sync_extras
from scaletrain.hardware.kernels import (
    ATTENTION_HEADS,
    ATTENTION_POINTS,
    COLLECTIVE_BYTES,
    COLLECTIVES,
    COPY_BYTES,
    KIB,
    STEP_BATCH,
    STEP_REPEATS,
    STEP_SEQ,
    attention_flops,
    attention_step,
    collective_functions,
    matmul_shapes,
    tiny_model_step,
)
from scaletrain.hardware.op_profile import count_dispatched_ops, step_profile
from scaletrain.hardware.timing import interleaved_seconds, median_seconds, rank0_counts, sync_extra_seconds


@dataclass(frozen=True)
class BenchPlan:
    matmul_n: int
    dtype: torch.dtype
    collective_bytes: tuple[int, ...]
    backend: str  # gloo or nccl (collectives)
    gpu_compute: bool  # compute on a GPU (rank r on cuda:r, or only rank 0 on cuda:0 when GPUs are fewer)
    compute: bool = True  # measure the compute curves (False: collectives only, for `scaletrain doctor`)


def measure_rank(rank: int, world: int, port: int | None, plan: BenchPlan) -> dict[str, list]:
    """One of `world` ranks meeting at 127.0.0.1:`port` (None: alone): its compute curves, then the collectives."""
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
            step = tiny_model_step(device)
            fns.append(step)
            ops = count_dispatched_ops(step)
        every = not plan.gpu_compute or nccl  # every rank computes (else rank 0 alone, on the one GPU)
        agree = partial(rank0_counts, port if every else None)
        seconds = interleaved_seconds(fns, sync, barrier, agree) if plan.compute else []
        res["matmul"] = [(m, n, k, 2.0 * m * n * k / t) for (m, n, k), t in zip(shapes, seconds)]
        res["copy"] = [(b, 2.0 * b / t) for b, t in zip(sizes, seconds[len(shapes) :])]
        at = seconds[len(shapes) + len(sizes) :]
        res["attention"] = [
            (s, d, attention_flops(s, d, attention_batch * ATTENTION_HEADS) / t) for (s, d), t in zip(attention, at)
        ]
        res["op"] = [t / ops for t in seconds[len(shapes) + len(sizes) + len(attention) :]]
        if computes and device_kind == "cpu":  # a real step op by op (a GPU would need a sync around every op)
            step = tiny_model_step(device, STEP_BATCH, STEP_SEQ)
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
                    slowest = torch.tensor([median_seconds(fn, sync, inner)], dtype=torch.float64).to(cdev)
                    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a collective ends with its slowest rank
                    size = nbytes if kind == "all_reduce" else gathered.numel() * 4
                    res[kind].append((size, float(slowest.cpu())))
            if plan.compute and not plan.gpu_compute:
                res["sync"] = sync_extra_seconds(world, barrier, gather)
        return res
    finally:
        if port is not None:
            dist.destroy_process_group()


def collective_backend(nproc: int) -> str:
    """nccl when every one of `nproc` local ranks has a GPU of its own, else gloo."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nproc else "gloo"


def bench_plan(host: HostInfo, nproc: int, matmul_n: int | None, collective_bytes: int) -> BenchPlan:
    """What `scaletrain bench` measures over `nproc` local ranks (GPU: bf16 matmuls; CPU: fp32). matmul_n: the
    largest square GEMM (default 1024 on a CPU, 8192 on a GPU); collectives at COLLECTIVE_BYTES up to
    `collective_bytes` (none with one rank)."""
    on_gpu = host.gpu_count > 0
    sizes = tuple(sorted({b for b in COLLECTIVE_BYTES if b < collective_bytes} | {collective_bytes}))
    return BenchPlan(
        matmul_n or (8192 if on_gpu else 1024),
        torch.bfloat16 if on_gpu else torch.float32,
        sizes if nproc > 1 else (),
        collective_backend(nproc),
        on_gpu,
    )


def collectives_plan(sizes: tuple[int, ...], nproc: int) -> BenchPlan:
    """Collectives only, at `sizes` bytes between `nproc` local ranks (`scaletrain doctor`)."""
    return BenchPlan(16, torch.float32, sizes, collective_backend(nproc), torch.cuda.is_available(), compute=False)


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask: a container's or taskset's limit, not the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def calibration_from(host: HostInfo, plan: BenchPlan, results: list[dict]) -> Calibration:
    """The calibration of this host from every rank's measure_rank results (by rank): the compute curves averaged
    over the ranks that computed, the collectives fitted to latency + bus bandwidth."""
    nproc = len(results)
    on_gpu = host.gpu_count > 0
    ranks = [r for r in results if r["matmul"]]  # the ranks that computed

    def mean_curve(name: str, keys: int) -> tuple[tuple[float, ...], ...]:
        # each point: the shape, and the mean over the computing ranks of what each got
        return tuple((*pts[0][:keys], statistics.fmean(p[keys] for p in pts)) for pts in zip(*(r[name] for r in ranks)))

    matmul, copy, attention = mean_curve("matmul", 3), mean_curve("copy", 1), mean_curve("attention", 2)
    step = step_figures([r["step"][0] for r in ranks if r["step"]])
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
        host_cores=None if on_gpu else usable_cores(),
        collective_amid_compute=sync,
        attention=attention,
        **step,
    )
