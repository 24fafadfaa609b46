"""The planner against published Megatron-LM runs (benchmarks/planner_published.py): a regression guard on a pure
computation, no timing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from scaletrain.plan.shapes import layer_params

ROOT = Path(__file__).resolve().parents[1]


def _published():
    spec = importlib.util.spec_from_file_location("planner_published", ROOT / "benchmarks/planner_published.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_korthikanti_table5_within_10_percent_on_average():
    pub = _published()
    cells = pub.calibration_table()
    assert len(cells) == 8
    errors = [p / m - 1 for *_, p, m in cells]
    assert pub.mean_abs_error([(p, m) for *_, p, m in cells]) <= 0.10, errors
    assert all(abs(e) <= 0.15 for e in errors), errors
    # selective recompute is faster than full recompute for every model, as published
    by = {(n, rc): p for n, rc, p, _ in cells}
    assert all(by[(r.name, "selective")] < by[(r.name, "full")] for r in pub.CALIBRATION)


def test_held_out_table_is_reported_and_stays_within_25_percent():
    pub = _published()
    held = pub.held_out_table()
    assert len(held) == len(pub.HELD_OUT)
    assert pub.mean_abs_error([(p, m) for _, p, m in held]) <= 0.25


def test_gpt_block_shape_counts_megatrons_parameters():
    pub = _published()
    run = pub.CALIBRATION[1]  # 175B: 12h^2 + 13h per layer (Narayanan et al. 2021 eq. 2)
    args = pub.shape(run)
    h = run.hidden
    assert layer_params(args) == 12 * h * h + 13 * h
    assert abs(args.num_params() / 175e9 - 1) < 0.02
