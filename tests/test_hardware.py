"""The hardware catalog carries a source for every figure; host detection is honest on a CPU host."""

from __future__ import annotations

import pytest
import torch

from scaletrain.hardware import GPUS, LINKS, apply_calibration, detect_host, get_gpu, load_calibration, make_cluster
from scaletrain.hardware.calibration import Calibration, CalibrationError, save_calibration


def test_every_figure_has_a_source():
    for g in GPUS.values():
        for figure in ("memory", "memory_bw", "bf16", "power", "matmul_efficiency", "fp32", "price"):
            assert g.sources.get(figure), (g.name, figure)
    for link in LINKS.values():
        for figure in ("bandwidth", "efficiency", "latency"):
            assert link.sources.get(figure), (link.name, figure)


def test_formulas_md_figures_and_unconfirmed_tags():
    h100 = get_gpu("h100-sxm")
    assert (h100.memory_bytes, h100.bf16_flops, h100.power_w, h100.memory_bw) == (80e9, 989e12, 700, 3.35e12)
    assert get_gpu("b200").bf16_flops == 2250e12 and get_gpu("h200").memory_bytes == 141e9
    assert get_gpu("l40s").memory_bytes == 48e9 and get_gpu("a100-80gb").bf16_flops == 312e12
    assert LINKS["nvlink4"].bandwidth == 450e9 and LINKS["ib-ndr"].bandwidth == 400e9 / 8
    # formulas.md marks these unconfirmed, and so must the catalog
    assert get_gpu("a100-40gb").is_unconfirmed("memory_bw")
    assert get_gpu("rtx-4090").is_unconfirmed("bf16") and get_gpu("rtx-4090").is_unconfirmed("power")
    assert get_gpu("l40s").is_unconfirmed("intra_link")
    assert not h100.is_unconfirmed("bf16")


def test_cluster_from_flags():
    c = make_cluster("h100-sxm", 64, "nvlink4,ib-ndr")
    assert (c.nodes, c.gpus_per_node, c.intra_link.name, c.inter_link.name) == (8, 8, "nvlink4", "ib-ndr")
    assert make_cluster("l40s", 4).gpus_per_node == 4  # under a node: one smaller node
    with pytest.raises(ValueError, match="--gpus"):
        make_cluster("h100-sxm", 0)


def test_detect_host_is_honest():
    host = detect_host()
    assert host.cpu_count >= 1
    if not torch.cuda.is_available():
        assert host.gpu_count == 0 and host.catalog_gpu == "cpu" and "no CUDA GPU" in host.describe()


def test_calibration_round_trip_and_errors(tmp_path):
    cal = Calibration("cpu", "box", 2, 1e11, "float32", 2e10, 1e9, 16e9, torch.__version__, 4e-6)
    path = tmp_path / "cal.toml"
    save_calibration(cal, path)
    assert load_calibration(path) == cal
    old = tmp_path / "old.toml"  # written before bench measured the dispatch overhead: still loads
    old.write_text("\n".join(line for line in path.read_text().splitlines() if "op_overhead_s" not in line))
    assert load_calibration(old).op_overhead_s is None
    assert apply_calibration(make_cluster("cpu", 2), load_calibration(old)).op_overhead_s == 4e-6  # catalog's
    assert apply_calibration(make_cluster("cpu", 2), cal).measured_op_overhead_s == 4e-6
    path.write_text(path.read_text().replace("matmul_flops = ", "matmul_flops = -"))
    with pytest.raises(CalibrationError, match="matmul_flops: must be a positive number"):
        load_calibration(path)
    with pytest.raises(CalibrationError, match="not found"):
        load_calibration(tmp_path / "missing.toml")
