"""How `scaletrain bench` times a call on ranks that share a host: medians of samples long enough to span a
scheduler slice, taken round-robin so that load coming and going falls on every curve alike, and the extra wait of
a collective issued amid compute (CPU)."""

from __future__ import annotations

import statistics
import time

import torch

from scaletrain.hardware.kernels import KIB

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


def median_seconds(fn, sync, inner: int, samples: int = 5) -> float:
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


def interleaved_seconds(fns, sync, barrier, agree=lambda counts: counts, rounds: int = ROUNDS) -> list[float]:
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


def rank0_counts(port: int | None, counts: list[int]) -> list[int]:
    """Rank 0's `counts` on every rank (one process: as they are)."""
    if port is None or not counts:
        return counts
    import torch.distributed as dist

    t = torch.tensor(counts, dtype=torch.int64)
    dist.broadcast(t, 0)
    return [int(x) for x in t]


def sync_extra_seconds(world: int, barrier, all_gather) -> list[tuple[float, float]]:
    """(gap, cost) points: seconds of compute between two collectives, and the seconds a SYNC_BYTES all-gather
    issued after that compute adds to it (fit.sync_extras subtracts what the all-gather fit charges). Every rank runs
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
