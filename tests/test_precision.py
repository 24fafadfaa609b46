"""bf16 and fp16 train without NaN on DDP and FSDP2 (fp16 with loss scaling)."""

import math

import pytest

from conftest import FAST, losses, run_cli
from scaletrain.monitor import read_jsonl

STEPS = ["train.steps=20", "monitor.log_interval=1"]


@pytest.mark.parametrize("dtype, layout", [
    ("bf16", "parallel.dp_shard=2"),
    ("bf16", "parallel.dp_replicate=2"),
    ("fp16", "parallel.dp_shard=2"),
    ("fp16", "parallel.dp_replicate=2"),
])
def test_low_precision_trains(tmp_path, dtype, layout):
    run_cli(["train", *FAST, *STEPS, f"precision.dtype={dtype}", layout, "run.name=p"], tmp_path)
    records = read_jsonl(tmp_path / "runs/p/metrics.jsonl")
    got = losses(tmp_path / "runs/p")
    assert len(got) == 20 and all(math.isfinite(x) for x in got)
    assert got[-1] < got[0] - 1.0
    if dtype == "fp16":
        assert all(r["loss_scale"] > 1 for r in records if "loss_scale" in r)
