"""One Layout type: the data-parallel mode is decided in one place and reads the same in logs, JSON, the planner's
vectorised columns, job resolution and setup()."""

import json

import numpy as np
import pytest

from scaletrain.config import load_config
from scaletrain.config.layout import DataParallelMode, Layout
from scaletrain.plan.layout import LayoutGrid

DEGREES = [(r, s, c) for r in (1, 2) for s in (1, 2, 4) for c in (1, 2)]


def test_mode_rule_text_and_the_planner_columns_agree():
    layouts = [Layout(r, s, 1, 1, c) for r, s, c in DEGREES]
    grid = LayoutGrid.of(layouts)
    for i, lay in enumerate(layouts):
        assert bool(grid.sharded[i]) == lay.mode.sharded
        assert bool(grid.ddp[i]) == (lay.mode is DataParallelMode.DDP)
        assert grid.row(i) == lay
    assert [Layout(1, 1).mode, Layout(2, 1).mode, Layout(1, 2).mode, Layout(2, 2).mode, Layout(1, 1, cp=2).mode] == [
        "single",
        "ddp",
        "fsdp",
        "hsdp",
        "fsdp",  # cp ranks join the FSDP shard group
    ]
    assert f"{DataParallelMode.HSDP}" == "hsdp" and json.dumps({"mode": DataParallelMode.DDP}) == '{"mode": "ddp"}'
    assert Layout(2, 2).describe_mesh() == "hsdp (dp_replicate=2 x dp_shard=2)"
    assert Layout(tp=2, pp=2).describe_mesh() == "pp=2 x tp=2"
    assert Layout().describe_mesh() == "single (one rank)"
    assert Layout(1, 8, micro_batch=1, accumulation=8, ac="full", precision="bf16").describe() == (
        "fsdp 8 · mb 1x8 · ac full · bf16"
    )
    assert np.array_equal(grid.dp, [lay.dp for lay in layouts])


def test_degrees_fill_the_world_or_name_the_field():
    assert Layout.from_degrees(load_config(None, ["parallel.tp=2"]).parallel, 8) == Layout(1, 4, 2, 1, 1)
    with pytest.raises(ValueError, match=r"^parallel: dp_replicate x tp x pp x cp = 3 does not divide"):
        Layout.from_degrees(load_config(None, ["parallel.tp=3"]).parallel, 8)
    with pytest.raises(ValueError, match=r"set parallel.dp_shard=-1 to fill it$"):
        Layout.from_degrees(load_config(None, ["parallel.dp_shard=2"]).parallel, 8)


def test_resolved_job_carries_the_layout_the_planner_would_write():
    from scaletrain.resolve import resolve_job

    overrides = [
        "parallel.dp_replicate=2",
        "parallel.dp_shard=2",
        "train.global_batch_size=16",
        "train.micro_batch_size=2",
    ]
    cfg = load_config(None, [*overrides, "data.source=synthetic", "precision.dtype=fp32"])
    layout = resolve_job(cfg, 4).layout
    assert layout == Layout(2, 2, 1, 1, 1, micro_batch=2, accumulation=2, precision="fp32")
    assert layout.mode is DataParallelMode.HSDP
    # the planner's settings of the resolved layout are the config's own
    applied = layout.apply(cfg)
    assert (applied.parallel, applied.train, applied.precision) == (cfg.parallel, cfg.train, cfg.precision)
