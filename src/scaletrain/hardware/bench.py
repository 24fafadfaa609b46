"""Measuring this host: matmul FLOP/s, copy bandwidth, host time per dispatched op, and all-reduce bus bandwidth
between local ranks.

The all-reduce runs through torch.distributed on a few local processes (gloo on CPUs, NCCL on GPUs), started with
torch.multiprocessing and meeting on 127.0.0.1; bus bandwidth follows nccl-tests: algbw x 2(n-1)/n.
"""

from __future__ import annotations

import os
import socket
import time

import torch

from scaletrain.hardware.calibration import Calibration
from scaletrain.hardware.detect import detect_host


def _timed(fn, repeats: int) -> float:
    """Best wall time of one call over `repeats` calls after one warm-up, seconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_matmul_flops(
    n: int = 1024, dtype: torch.dtype = torch.float32, device: str = "cpu", repeats: int = 5
) -> float:
    """Achieved FLOP/s of an n x n x n matmul (2n^3 FLOPs), best of `repeats`."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return 2.0 * n**3 / _timed(lambda: torch.mm(a, b), repeats)


def measure_memory_bw(nbytes: int = 64 * 2**20, device: str = "cpu", repeats: int = 5) -> float:
    """Achieved bytes/s of a large copy, counting the read and the write."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    return 2.0 * nbytes / _timed(lambda: dst.copy_(src), repeats)


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


def measure_op_overhead(device: str = "cpu", repeats: int = 5, iterations: int = 20) -> float:
    """Host seconds per dispatched op: forward + backward of the built-in `tiny` model on 8 tokens, where the
    kernels are too small to matter, divided by the ops it dispatches (the planner's OPS_PER_BLOCK count)."""
    import torch.nn.functional as F

    from scaletrain.models import preset_spec

    spec = preset_spec("tiny")
    model = spec.build("meta").to_empty(device=device)
    spec.init_weights(model, seed=0)
    tokens = torch.randint(0, spec.vocab_size, (1, 8), device=device)

    def step() -> None:
        logits = model(tokens)
        F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten(), reduction="sum").backward()
        model.zero_grad(set_to_none=True)

    ops = count_dispatched_ops(step)

    def steps() -> None:
        for _ in range(iterations):
            step()

    seconds = _timed(steps, repeats)
    return seconds / (iterations * ops)


def _allreduce_worker(rank: int, world: int, port: int, nbytes: int, repeats: int, backend: str, out) -> None:
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        device = f"cuda:{rank}" if backend == "nccl" else "cpu"
        if backend == "nccl":
            torch.cuda.set_device(rank)
        t = torch.ones(nbytes // 4, dtype=torch.float32, device=device)

        def once() -> None:
            dist.all_reduce(t)
            if backend == "nccl":
                torch.cuda.synchronize()

        once()
        dist.barrier()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
        slowest = torch.tensor([min(times)], dtype=torch.float64)
        dist.all_reduce(slowest.to(device), op=dist.ReduceOp.MAX) if backend == "nccl" else dist.all_reduce(
            slowest, op=dist.ReduceOp.MAX
        )
        if rank == 0:
            out.put(float(slowest))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_allreduce_busbw(nproc: int = 2, nbytes: int = 16 * 2**20, repeats: int = 5) -> float:
    """All-reduce bus bandwidth between `nproc` local ranks, bytes/s (algbw x 2(n-1)/n, as nccl-tests)."""
    import torch.multiprocessing as mp

    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nproc else "gloo"
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(
        _allreduce_worker,
        args=(nproc, _free_port(), nbytes, repeats, backend, out),
        nprocs=nproc,
        join=True,
        start_method="spawn",
    )
    seconds = out.get()
    return nbytes / seconds * 2.0 * (nproc - 1) / nproc


def run_bench(nproc: int = 2, matmul_n: int = 1024, allreduce_bytes: int = 16 * 2**20) -> Calibration:
    """Measure this host and return its calibration (GPU: bf16 matmul on device 0; CPU: fp32 matmul)."""
    host = detect_host()
    on_gpu = host.gpu_count > 0
    device = "cuda" if on_gpu else "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    flops = measure_matmul_flops(matmul_n, dtype, device)
    mem_bw = measure_memory_bw(device=device)
    op_s = measure_op_overhead(device)
    busbw = measure_allreduce_busbw(nproc, allreduce_bytes)
    memory = float(host.gpu_memory_bytes[0]) if on_gpu else host.memory_bytes
    return Calibration(
        device=host.catalog_gpu,
        host=host.hostname,
        ranks=nproc,
        matmul_flops=flops,
        matmul_dtype=str(dtype).removeprefix("torch."),
        memory_bw=mem_bw,
        allreduce_busbw=busbw,
        memory_bytes=memory,
        torch_version=torch.__version__,
        op_overhead_s=op_s,
    )
