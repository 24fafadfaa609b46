"""Fitting what `scaletrain bench` measured: collective times to latency per ring step + bus bandwidth, the wait
of a collective amid compute beyond that fit, and the rates of a profiled step's kernels."""

from __future__ import annotations

import math
import statistics

import numpy as np

from scaletrain.hardware.timing import SYNC_BYTES


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


def step_figures(profiles: list[dict]) -> dict:
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
