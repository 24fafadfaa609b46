"""`scaletrain bench` on one host: hardware/bench.py's measurement in `nproc` local ranks (launch/local.py
run_local_ranks), fitted into the host's calibration; and the one all-reduce `scaletrain doctor` times."""

from __future__ import annotations

import torch

from scaletrain.hardware.bench import BenchPlan, bench_plan, calibration_from, collectives_plan, measure_rank
from scaletrain.hardware.calibration import Calibration
from scaletrain.hardware.detect import detect_host
from scaletrain.hardware.kernels import MIB, tiny_model_step
from scaletrain.launch.local import run_local_ranks


def _measure_ranks(nproc: int, plan: BenchPlan) -> list[dict]:
    """measure_rank on `nproc` fresh local ranks; results by rank. Without a GPU they are forked: they inherit torch
    and the caller's modules instead of importing them again (on 2 busy cores, 4 spawned ranks took 35 s to start);
    CUDA cannot be forked, so with a GPU they are spawned."""
    method = "spawn" if plan.gpu_compute or plan.backend == "nccl" else "fork"
    if method == "fork" and plan.compute:  # the first steps of a model pay one-time set-up: pay it once, here
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # no OpenMP thread pool in the parent: libgomp's is not safe to fork
        try:
            tiny_model_step()()
        finally:
            torch.set_num_threads(threads)
    return run_local_ranks(measure_rank, nproc, (plan,), start_method=method)


def run_bench(nproc: int = 2, matmul_n: int | None = None, collective_bytes: int = 16 * MIB) -> Calibration:
    """Measure this host's curves over `nproc` local ranks and return its calibration (GPU: bf16 matmuls;
    CPU: fp32). matmul_n: the largest square GEMM (default 1024 on a CPU, 8192 on a GPU); collectives up to
    `collective_bytes` (none with one rank)."""
    host = detect_host()
    plan = bench_plan(host, nproc, matmul_n, collective_bytes)
    return calibration_from(host, plan, _measure_ranks(nproc, plan))


def measure_allreduce_busbw(nproc: int = 2, nbytes: int = 16 * MIB) -> float:
    """All-reduce bus bandwidth between `nproc` local ranks at one message size, bytes/s (algbw x 2(n-1)/n)."""
    fields = _measure_ranks(nproc, collectives_plan((nbytes,), nproc))[0]
    return 2.0 * (nproc - 1) / nproc * nbytes / fields["all_reduce"][0][1]
