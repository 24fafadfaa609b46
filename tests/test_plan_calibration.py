"""`scaletrain bench` curves in the planner: a calibration file's measured points round-trip, and the planner costs
GEMMs, memory-bound kernels and collectives on them (pure computation on synthetic calibrations, no timing)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from scaletrain.hardware import Calibration, apply_calibration, load_calibration, make_cluster
from scaletrain.hardware.fit import fit_latency_bandwidth
from scaletrain.hardware.kernels import matmul_shapes
from scaletrain.hardware.calibration import CalibrationError, intensity, save_calibration
from scaletrain.models import preset_spec
from scaletrain.plan import Layout, Workload, evaluate_layout
from scaletrain.plan.comm import collective_seconds
from scaletrain.plan.efficiency import gemm_seconds, measured_curve, memory_seconds

FLAT = 50e9  # FLOP/s of every shape in the flat calibration


def calibration(small_rate: float = FLAT, small_copy_bw: float = 10e9) -> Calibration:
    """A 4-rank CPU calibration: 50 GFLOP/s for GEMMs of intensity >= 170 (256^3 and up), `small_rate` below
    intensity 45 (64^3 and skinnier); copies at 10 GB/s from 16 MiB, `small_copy_bw` at 64 KiB; all-reduce 1 GB/s
    + 100 us per ring step, all-gather 0.5 GB/s + 50 us."""
    matmul = tuple((m, n, k, FLAT if intensity(m, n, k) >= 170 else small_rate) for m, n, k in matmul_shapes(1024))
    copy = ((65536.0, small_copy_bw), (16 * 2.0**20, 10e9), (64 * 2.0**20, 10e9))
    return Calibration(
        "cpu", "box", 4, FLAT, "float32", 10e9, 1e9, None, "2.13.0", 5e-6,
        allreduce_latency_s=100e-6, allgather_busbw=0.5e9, allgather_latency_s=50e-6,
        matmul=matmul, copy=copy,
        all_reduce=((4096.0, 6 * 100e-6 + 1.5 * 4096 / 1e9),),
        all_gather=((4096.0, 3 * 50e-6 + 0.75 * 4096 / 0.5e9),),
    )  # fmt: skip


def test_calibration_with_curves_round_trips_and_refuses_bad_points(tmp_path):
    cal = calibration(small_rate=10e9)
    path = tmp_path / "cal.toml"
    save_calibration(cal, path)
    text = path.read_text()
    assert "\nmatmul = [" in text and "\nall_gather = [" in text
    assert load_calibration(path) == cal
    scatter = dataclasses.replace(
        cal, reducescatter_busbw=0.25e9, reducescatter_latency_s=80e-6, reduce_scatter=((4096.0, 1e-3),)
    )
    save_calibration(scatter, path)
    assert load_calibration(path) == scatter
    path.write_text(path.read_text().replace("reducescatter_busbw = 250000000.0", "reducescatter_busbw = -1"))
    with pytest.raises(CalibrationError, match="reducescatter_busbw: must be a positive number"):
        load_calibration(path)
    path.write_text(text)
    path.write_text(text.replace("bandwidth = 10000000000.0", "bandwidth = 0", 1))
    with pytest.raises(CalibrationError, match=r"copy\[\d\]\.bandwidth: must be a positive number"):
        load_calibration(path)
    path.write_text(text.replace("flops = 50000000000.0 }", "flop = 1 }", 1))
    with pytest.raises(CalibrationError, match=r"matmul\[\d\]: needs exactly the keys m, n, k, flops"):
        load_calibration(path)


def test_measured_curve_interpolates_in_log_space_and_holds_flat_beyond():
    pts = ((10.0, 1.0), (1000.0, 100.0))
    assert measured_curve(100.0, pts) == pytest.approx(10.0)  # the geometric midpoint
    assert measured_curve(1.0, pts) == pytest.approx(1.0) and measured_curve(1e6, pts) == pytest.approx(100.0)


def test_gemms_and_kernels_run_at_their_measured_rates():
    cluster = apply_calibration(make_cluster("cpu", 4, gpus_per_node=4), calibration(10e9, small_copy_bw=40e9))
    big = gemm_seconds(1024, 1024, 1024, FLAT, cluster, 4.0)
    assert big == pytest.approx(2 * 1024**3 / FLAT)
    small = gemm_seconds(64, 64, 64, FLAT, cluster, 4.0)
    assert small == pytest.approx(2 * 64**3 / 10e9)  # a measured shape: its measured rate
    # between intensity 43 and 170: a rate between the two, closer to the small one nearer it
    mid = 2 * 4096 * 128 * 128 / gemm_seconds(4096, 128, 128, FLAT, cluster, 4.0)
    assert 10e9 < mid < FLAT
    assert memory_seconds(2 * 65536.0, cluster) == pytest.approx(2 * 65536 / 40e9)  # cache-sized copy
    assert memory_seconds(1e9, cluster, 1e8) == pytest.approx(1e9 / 10e9)


def test_collectives_use_the_measured_latency_and_bandwidth_per_kind():
    cluster = apply_calibration(make_cluster("cpu", 4, gpus_per_node=4), calibration())
    S = 8e6
    assert collective_seconds("all_reduce", S, 4, 1, cluster) == pytest.approx(2 * 3 / 4 * S / 1e9 + 2 * 3 * 100e-6)
    assert collective_seconds("all_gather", S, 4, 1, cluster) == pytest.approx(3 / 4 * S / 0.5e9 + 3 * 50e-6)
    # a file without a measured reduce-scatter: as an all-gather, which moves as much
    assert collective_seconds("reduce_scatter", S, 4, 1, cluster) == collective_seconds("all_gather", S, 4, 1, cluster)
    # measured (gloo's costs about an all-reduce): its own fit, the other kinds unchanged
    cal = dataclasses.replace(calibration(), reducescatter_busbw=0.25e9, reducescatter_latency_s=80e-6)
    measured = apply_calibration(make_cluster("cpu", 4, gpus_per_node=4), cal)
    assert collective_seconds("reduce_scatter", S, 4, 1, measured) == pytest.approx(3 / 4 * S / 0.25e9 + 3 * 80e-6)
    assert collective_seconds("all_gather", S, 4, 1, measured) == collective_seconds("all_gather", S, 4, 1, cluster)
    # the fit bench applies recovers latency and bus bandwidth from exact points of the ring model
    pts = [(b, 6 * 100e-6 + 1.5 * b / 1e9) for b in (4096, 65536, 2**20, 16 * 2**20)]
    lat, busbw = fit_latency_bandwidth(pts, steps=6, volume=1.5)
    assert lat == pytest.approx(100e-6) and busbw == pytest.approx(1e9)


def test_the_planner_uses_the_measured_matmul_curve():
    """The tiny model's GEMMs (1024 tokens x 128 wide) have low intensity: measured 5x slower than large ones,
    the planner's compute time grows, and by less than 5x (its attention, pointwise and large GEMMs stay)."""
    work = Workload("tiny", preset_spec("tiny").shape(), 256, 16)
    layout = Layout(4, 1, 1, 1, 1, 4, 1, "none", "fp32", "none")

    def compute(cal: Calibration) -> float:
        cluster = apply_calibration(make_cluster("cpu", 4, gpus_per_node=4), cal)
        return evaluate_layout(work, cluster, layout).time["compute"]

    flat, slow = compute(calibration()), compute(calibration(small_rate=FLAT / 5))
    assert 1.5 * flat < slow < 5 * flat
    # a file written before the curves (scalar figures only) keeps the aggregate-FLOPs model
    old = dataclasses.replace(calibration(), matmul=(), copy=(), allreduce_latency_s=None, allgather_busbw=None)
    assert apply_calibration(make_cluster("cpu", 4), old).measured_matmul_curve is None
    assert np.isfinite(compute(old)) and compute(old) > 0
