"""Index arrays (an epoch's shuffled sample order, a Megatron dataset's document starts), built once and shared
through a file that every rank memory-maps.

The permutation of epoch e over n samples depends only on (n, seed, e), so its file name says exactly that and any
rank, job or world size that needs it reuses it. Building is guarded by an O_EXCL lock file: one process builds
(torch.randperm, then np.save to a temporary file and an atomic rename), the others wait for the file and map it.
A builder that died leaves a stale lock; a waiter that times out builds its own copy, which is harmless because the
content is deterministic and the rename atomic. Without a cache folder (in-memory sources) the order stays in memory.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

WAIT_S = 120.0  # how long a rank waits for another's build before building itself (a 1e9-sample order takes ~30 s)


def permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The order of epoch `epoch` (int64, a permutation of range(n)); the same generator the loader always used."""
    gen = torch.Generator().manual_seed(seed * 7_919 + epoch)
    return torch.randperm(n, generator=gen).numpy()


def _save_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, array)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def cached_array(path: Path, build: Callable[[], np.ndarray]) -> np.ndarray:
    """The array at `path` memory-mapped, built first by one process (see above) when missing."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = path.with_name(path.name + ".lock")
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            deadline = time.monotonic() + WAIT_S
            while not path.is_file() and lock.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            if not path.is_file():
                _save_atomic(path, build())
        else:
            try:
                _save_atomic(path, build())
            finally:
                os.close(fd)
                lock.unlink(missing_ok=True)
    return np.load(path, mmap_mode="r")


def cached_permutation(cache_dir: Path | None, n: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch's order, memory-mapped from cache_dir (built there first if missing), or in memory without one."""
    if cache_dir is None:
        return permutation(n, seed, epoch)
    return cached_array(cache_dir / f"order-n{n}-seed{seed}-epoch{epoch}.npy", lambda: permutation(n, seed, epoch))
