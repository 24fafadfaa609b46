"""The planner's CPU-only terms (docs/planner.md, "CPU ranks sharing cores"), pure computation on synthetic
calibrations: GEMMs by shape, the wait of a collective amid compute per FSDP unit / DDP bucket / TP op, and the
pipeline's bubble and waits filled by a work-conserving scheduler when ranks outnumber cores."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from scaletrain.hardware import Calibration, apply_calibration, load_calibration, make_cluster
from scaletrain.hardware.kernels import matmul_shapes
from scaletrain.hardware.calibration import CalibrationError, save_calibration
from scaletrain.models import preset_spec
from scaletrain.plan import Layout, Workload, evaluate_layout
from scaletrain.plan.efficiency import amid_compute_seconds, gemm_seconds, nondecreasing, shape_rate
from scaletrain.plan.steptime import TIME_LINES, share_cores

WAIT = 0.01  # seconds every collective amid compute waits in the flat curve below


def calibration(cores: int | None = 2, wait: float = WAIT) -> Calibration:
    """4 CPU ranks: GEMMs at 40 GFLOP/s when their working set is under 2^18 elements (1 MiB fp32), else 10; a
    collective amid compute waits `wait` s whatever the gap (1 us .. 10 s)."""

    def rate(m, n, k):
        return 40e9 if m * k + k * n + m * n < 2**18 else 10e9

    return Calibration(
        "cpu", "box", 4, 40e9, "float32", 10e9, 1e9, None, "2.13.0", 5e-6,
        allreduce_latency_s=100e-6, allgather_busbw=0.5e9, allgather_latency_s=50e-6,
        matmul=tuple((m, n, k, rate(m, n, k)) for m, n, k in matmul_shapes(1024)),
        copy=((65536.0, 10e9), (64 * 2.0**20, 10e9)),
        host_cores=cores,
        collective_amid_compute=((1e-6, wait), (10.0, wait)) if wait else (),
    )  # fmt: skip


def cluster(cal: Calibration):
    return apply_calibration(make_cluster("cpu", 4, gpus_per_node=4), cal)


WORK = Workload("tiny", preset_spec("tiny").shape(), 256, 16)
DDP4 = Layout(4, 1, 1, 1, 1, 4, 1, "none", "fp32", "none")
FSDP4 = Layout(1, 4, 1, 1, 1, 4, 1, "none", "fp32", "none")
PP4 = Layout(1, 1, 1, 4, 1, 1, 16, "none", "fp32", "1F1B")
TP2_PP2 = Layout(1, 1, 2, 2, 1, 1, 16, "none", "fp32", "1F1B")


def test_calibration_keeps_the_cores_and_the_wait_curve(tmp_path):
    cal = calibration()
    path = tmp_path / "cal.toml"
    save_calibration(cal, path)
    assert load_calibration(path) == cal
    c = cluster(cal)
    assert c.host_cores == 2 and c.measured_sync_curve == ((1e-6, WAIT), (10.0, WAIT))
    assert c.measured_matmul_shapes is not None and len(c.measured_matmul_shapes) == len(cal.matmul)
    path.write_text(path.read_text().replace("host_cores = 2", "host_cores = 0"))
    with pytest.raises(CalibrationError, match="host_cores: must be a whole number of cores, at least 1"):
        load_calibration(path)
    # a GPU calibration (no cores recorded) keeps the intensity curve and no CPU terms
    assert cluster(dataclasses.replace(cal, host_cores=None)).measured_matmul_shapes is None


def test_gemms_on_a_cpu_run_at_the_rate_of_the_nearest_measured_working_set():
    c = cluster(calibration())
    for m, n, k in ((256, 256, 256), (1024, 1024, 1024)):  # measured shapes: their own rate
        assert 2.0 * m * n * k / gemm_seconds(m, n, k, 40e9, c, 4.0) == pytest.approx(
            40e9 if (m, n, k) == (256, 256, 256) else 10e9, rel=1e-6
        )
    # the tiny model's linears: 256 tokens fit the cache and run faster than 1024 tokens, same intensity class
    small, large = (float(shape_rate(t, 352, 128, c.measured_matmul_shapes)) for t in (256, 1024))
    assert 10e9 <= large < small <= 40e9


def test_a_collective_amid_compute_waits_the_measured_extra():
    c = cluster(calibration())
    assert amid_compute_seconds(0.5, 4, c) == pytest.approx(WAIT)
    assert amid_compute_seconds(0.5, 1, c) == 0.0  # no group, no wait
    assert amid_compute_seconds(0.0, 4, c) == 0.0  # no compute between, no spread in arrival
    ramp = cluster(dataclasses.replace(calibration(), collective_amid_compute=((0.01, 0.002), (0.04, 0.008))))
    assert amid_compute_seconds(0.005, 2, ramp) == pytest.approx(0.001)  # linear through zero
    assert amid_compute_seconds(0.025, 2, ramp) == pytest.approx(0.005)
    assert amid_compute_seconds(1.0, 2, ramp) == pytest.approx(0.008)  # flat beyond the largest gap
    assert amid_compute_seconds(0.5, 4, cluster(calibration(wait=0))) == 0.0


def test_fsdp_pays_the_wait_per_unit_and_ddp_per_bucket():
    """tiny: 4 blocks + the root = 5 FSDP units; one micro-batch: 5 gathers forward, 4 backward (the root stays
    gathered), 5 reduce-scatters; DDP: one bucket (the tiny model's gradients are under 25 MB)."""
    with_wait, without = cluster(calibration()), cluster(calibration(wait=0))

    def extra(layout: Layout) -> float:
        lines = (evaluate_layout(WORK, c, layout).time["dp comm exposed"] for c in (with_wait, without))
        return next(lines) - next(lines)

    assert extra(FSDP4) == pytest.approx(14 * WAIT)
    assert extra(DDP4) == pytest.approx(WAIT)


def test_a_traced_plan_pays_the_same_waits_as_the_decoder_formulas():
    """plan/traced.py (every family that is not a Llama-shaped decoder) counts the collective waits as
    plan/steptime.py does: tiny traced has the same 5 FSDP units and one DDP bucket; with accumulation 2 FSDP pays
    them per micro-batch, DDP once per step."""
    from scaletrain.plan.trace import spec_target, trace_model
    from scaletrain.plan.traced import traced_time

    trace = trace_model(spec_target(preset_spec("tiny"), 256), "fp32")
    with_wait, without = cluster(calibration()), cluster(calibration(wait=0))

    def extra(layout: Layout) -> float:
        lines = (traced_time(trace, layout, c)["dp comm exposed"] for c in (with_wait, without))
        return next(lines) - next(lines)

    assert trace.n_blocks == 4
    assert extra(FSDP4) == pytest.approx(14 * WAIT)
    assert extra(DDP4) == pytest.approx(WAIT)
    assert extra(dataclasses.replace(FSDP4, micro_batch=2, accumulation=2)) == pytest.approx(28 * WAIT)
    assert extra(dataclasses.replace(DDP4, micro_batch=2, accumulation=2)) == pytest.approx(WAIT)


def test_bubble_and_pipeline_waits_are_filled_when_ranks_outnumber_cores():
    shared, own = cluster(calibration(cores=2)), cluster(calibration(cores=4))
    for layout in (PP4, TP2_PP2):
        a, b = evaluate_layout(WORK, shared, layout), evaluate_layout(WORK, own, layout)
        assert b.time["bubble"] > 0 and a.time["bubble"] < b.time["bubble"]
        assert a.step_s < b.step_s and a.step_s == pytest.approx(sum(a.time[k] for k in TIME_LINES))
    # 16 micro-batches on 4 stages: the bubble (3/16 of the work) fits in the cores the others leave
    assert evaluate_layout(WORK, shared, PP4).time["bubble"] == pytest.approx(0.0, abs=1e-12)
    # without a pipeline nothing changes: every rank syncs in step, the measured wait already holds the scheduler
    for layout in (DDP4, FSDP4):
        assert evaluate_layout(WORK, shared, layout).time == evaluate_layout(WORK, own, layout).time


def test_share_cores_is_max_of_the_critical_path_at_a_core_and_the_work():
    c = cluster(calibration(cores=2))  # 4 ranks on 2 cores: a waiting rank's core doubles another's pace
    zero = np.zeros(1)
    lines = {k: zero for k in TIME_LINES} | {"compute": np.asarray([10.0]), "tp comm": np.asarray([3.0])}
    waits = {"tp comm": np.asarray([2.0]), "dp comm exposed": zero}
    for bubble, pp, step in ((4.0, 2, 11.0), (30.0, 2, 21.5), (4.0, 1, 13.0)):
        out = share_cores(lines | {"bubble": np.asarray([bubble])}, waits, np.asarray([pp]), c)
        assert sum(float(out[k][0]) for k in TIME_LINES) == pytest.approx(step)
        assert all(float(v[0]) >= 0 for v in out.values())
    # (10 compute + 1 tp comm of work) + 2 waits + 4 bubble = 17 at half a core each -> 8.5 < 11: the work
    # decides; with a 30 s bubble (43 / 2 = 21.5) the critical path does; pp = 1 (not a pipeline): the waits
    # count as work (13)


def test_a_scattered_wait_curve_is_read_through_its_nondecreasing_fit():
    assert nondecreasing([1.0, 3.0, 2.0, 4.0, 0.0]) == pytest.approx([1.0, 2.25, 2.25, 2.25, 2.25])
    c = cluster(dataclasses.replace(calibration(), collective_amid_compute=((0.01, 0.004), (0.1, 1e-9))))
    assert amid_compute_seconds(0.1, 4, c) == pytest.approx(0.002)  # the large-gap sample fell to noise


def test_attention_and_a_real_steps_kernels_come_from_the_measurement():
    """bench's attention curve prices the attention core; what a real step's GEMMs and attention achieved (bench's
    step_profile) scales the curves; the memory-bound ops run at the bandwidth measured inside that step."""
    from scaletrain.plan.efficiency import attention_seconds, in_step_factors, pointwise_seconds

    attention = ((128.0, 32.0, 5e9), (1024.0, 32.0, 10e9), (128.0, 128.0, 8e9), (1024.0, 128.0, 16e9))
    measured = dataclasses.replace(calibration(), attention=attention)
    c = cluster(measured)
    # a measured point at its own rate: 3 x 2 s^2 d FLOPs per head, a third of the time in forward
    fwd, bwd = attention_seconds(1024.0, 32.0, 8.0, c)
    assert fwd + bwd == pytest.approx(6.0 * 1024**2 * 32 * 8 / 10e9) and bwd == pytest.approx(2 * fwd)
    # between the points: between their rates
    fwd, bwd = attention_seconds(256.0, 64.0, 1.0, c)
    assert 5e9 < 6.0 * 256**2 * 64 / (fwd + bwd) < 16e9
    assert in_step_factors(c) == (1.0, 1.0) and attention_seconds(256.0, 64.0, 1.0, cluster(calibration())) is None
    # in the step its GEMMs ran at half the curve's rate and its attention at a quarter: the planner follows
    shapes = ((1024.0, 352.0, 128.0), (352.0, 128.0, 1024.0), (256.0, 256.0, 256.0))
    step = dataclasses.replace(
        measured,
        step_matmul=tuple((m, n, k, float(shape_rate(m, n, k, c.measured_matmul_shapes)) / 2) for m, n, k in shapes),
        step_attention=((256.0, 32.0, float(6 * 256**2 * 32 / sum(attention_seconds(256.0, 32.0, 1.0, c))) / 4),),
        step_pointwise_bw=2e9,
    )
    s = cluster(step)
    assert in_step_factors(s) == pytest.approx((2.0, 4.0))
    assert gemm_seconds(1024, 352, 128, 40e9, s, 4.0) == pytest.approx(2 * gemm_seconds(1024, 352, 128, 40e9, c, 4.0))
    assert sum(attention_seconds(512.0, 64.0, 2.0, s)) == pytest.approx(4 * sum(attention_seconds(512.0, 64.0, 2.0, c)))
    assert pointwise_seconds(1e9, 1e6, s) == pytest.approx(0.5)  # 1 GB at the step's 2 GB/s, whatever the kernel
    assert pointwise_seconds(1e9, 1e6, c) == pytest.approx(0.1)  # else the copy curve's 10 GB/s
    # and the step as a whole: slower by exactly what the measurement says; the optimizer's memory traffic also
    # runs at the step's bandwidth (2 GB/s instead of the copy curve's 10)
    a, b = evaluate_layout(WORK, c, DDP4), evaluate_layout(WORK, s, DDP4)
    assert b.time["compute"] > 2 * a.time["compute"] and b.time["optimizer"] == pytest.approx(5 * a.time["optimizer"])
    # a GPU calibration (no cores) keeps no in-step figures
    assert cluster(dataclasses.replace(step, host_cores=None)).measured_step_pointwise_bw is None


def test_calibration_round_trips_the_attention_and_step_figures(tmp_path):
    cal = dataclasses.replace(
        calibration(),
        attention=((128.0, 32.0, 5e9), (512.0, 64.0, 7e9)),
        step_matmul=((1024.0, 352.0, 128.0, 3e10),),
        step_attention=((256.0, 32.0, 2e9),),
        step_pointwise_bw=8e9,
    )
    path = tmp_path / "cal.toml"
    save_calibration(cal, path)
    assert load_calibration(path) == cal
    path.write_text(path.read_text().replace("step_pointwise_bw = 8000000000.0", "step_pointwise_bw = -1"))
    with pytest.raises(CalibrationError, match="step_pointwise_bw: must be a positive number"):
        load_calibration(path)
