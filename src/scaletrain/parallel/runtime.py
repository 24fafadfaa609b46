"""Joining the process group: under the torchrun agent, under an external `torchrun`, or as a lone process."""

from __future__ import annotations

import atexit
import datetime
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from scaletrain.parallel.network import worker_store
from scaletrain.parallel.rank_env import apply_mpi_env


@dataclass(frozen=True)
class Runtime:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str


# glibc's mallopt parameters (malloc.h) and the most it accepts for the mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_BYTES = 32 << 20
_TRIM_THRESHOLD_BYTES = 1 << 30


def keep_freed_host_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of handing it back to the kernel (CPU ranks).

    A training step frees and reallocates the same activation and gradient buffers (MiBs each) every step; with
    glibc's defaults the top of the heap is trimmed and large blocks are munmap-ed, so the next step takes them back
    through page faults (5,000-8,000 per step on the tiny model, 4-7 % of a CPU step), and under FSDP every rank
    waits for the slowest at each all-gather. PyTorch's CPU tuning guide swaps in jemalloc/tcmalloc for this; glibc's
    own thresholds do it without a preload. Skipped when the user set malloc tunables or another allocator is
    preloaded; returns whether the thresholds were set."""
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc" or os.environ.get("LD_PRELOAD"):
        return False
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "") or any(k.startswith("MALLOC_") for k in os.environ):
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(
            libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
            and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)
        )
    except (OSError, AttributeError):
        return False


def pick_device_type(requested: str) -> str:
    """'cuda' when asked for or when auto finds GPUs, else 'cpu'. ValueError if cuda is asked for but absent."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("run.device: 'cuda' requested but no CUDA GPU is visible; use run.device=cpu or auto")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def init_distributed(device_type: str, timeout_s: float = 600.0, rdzv_endpoint: str | None = None) -> Runtime:
    """Join (or reuse) the default process group: NCCL on GPUs, gloo on CPUs.

    With RANK/WORLD_SIZE in the environment (torchrun) the env:// rendezvous is used; under `mpirun`/`mpiexec`
    the MPI rank variables are mapped to them first (MASTER_ADDR/PORT from the environment, else rdzv_endpoint);
    otherwise a one-rank group on an in-memory store, so the same code runs in a plain `python` process.
    """
    backend = "nccl" if device_type == "cuda" else "gloo"
    if not dist.is_initialized():
        apply_mpi_env(os.environ, rdzv_endpoint)
        timeout = datetime.timedelta(seconds=timeout_s)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            # rank 0's store on MASTER_ADDR only: torch's env:// one would listen on every interface
            store = worker_store(os.environ, timeout_s)
            if store is None:
                dist.init_process_group(backend, timeout=timeout)
            else:
                dist.init_process_group(
                    backend,
                    store=store,
                    rank=int(os.environ["RANK"]),
                    world_size=int(os.environ["WORLD_SIZE"]),
                    timeout=timeout,
                )
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        atexit.register(shutdown_distributed)  # a no-op when the caller already left the group
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device_type == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        keep_freed_host_memory()
    return Runtime(rank, local_rank, world, device, dist.get_backend())


def shutdown_distributed(wait_for_peers: bool = True) -> None:
    """Leave the process group cleanly: wait for every rank, then destroy all groups while Python still runs.

    Without this a gloo worker thread can drop the last reference to a tensor of a finished collective after the
    interpreter began finalising; it then cannot take the GIL and the process aborts (SIGABRT, "terminate called
    without an active exception") although training had finished. Seen here with FSDP2 + fp16 on CPU ranks.
    wait_for_peers=False (a rank that failed alone): no barrier, which the other ranks, waiting in the collective
    the failed rank never reached, would never join; the rank exits and its launcher stops the others.
    """
    if not dist.is_initialized():
        return
    try:
        if wait_for_peers and dist.get_world_size() > 1:
            dist.barrier()
    finally:
        dist.destroy_process_group()
        gc.collect()
