"""`scaletrain plan CONFIG.toml [key=value ...]`: the layout fields a job config sets pin the planner's search;
all of them pinned evaluate that one layout, fitting or not."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from scaletrain.cli.main import main

BASE = '[model]\nname = "llama-8b"\n[data]\nseq_len = 4096\n[train]\nglobal_batch_size = 64\n'
FLAGS = ["--gpus", "16", "--gpu", "h100-sxm", "--interconnect", "nvlink4,ib-ndr", "--json", "--top", "1000"]


def plan_json(tmp_path, overrides, flags=FLAGS):
    cfg = tmp_path / "job.toml"
    cfg.write_text(BASE)
    r = CliRunner().invoke(main, ["plan", str(cfg), *overrides, *flags])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


SUBSETS = [
    {"parallel.tp": 4},
    {"parallel.tp": 2, "parallel.pp": 2},
    {"precision.dtype": "bf16", "parallel.activation_checkpoint": "selective"},
    {"parallel.dp_shard": 8, "train.micro_batch_size": 2},
    {"parallel.dp_replicate": 2, "parallel.pp": 4, "parallel.pp_schedule": "Interleaved1F1B"},
]


@pytest.mark.parametrize("pins", SUBSETS, ids=lambda p: ",".join(k.split(".")[1] for k in p))
def test_pinning_any_subset_returns_only_matching_layouts(tmp_path, pins):
    field = {
        "parallel.tp": "tp",
        "parallel.pp": "pp",
        "parallel.dp_shard": "dp_shard",
        "parallel.dp_replicate": "dp_replicate",
        "parallel.activation_checkpoint": "ac",
        "parallel.pp_schedule": "schedule",
        "train.micro_batch_size": "micro_batch",
        "precision.dtype": "precision",
    }
    data = plan_json(tmp_path, [f"{k}={v}" for k, v in pins.items()])
    assert data["pinned"] == pins and not data["evaluated"]
    assert data["layouts"], "pins that fit must leave layouts"
    free = plan_json(tmp_path, [])
    assert free["fitting"] > data["fitting"]  # the pins did narrow the search
    for row in data["layouts"]:
        lay = row["layout"]
        assert row["fits"]
        assert all(lay[field[k]] == v for k, v in pins.items()), (lay, pins)
        assert lay["micro_batch"] * lay["accumulation"] * lay["dp_replicate"] * lay["dp_shard"] == 64


def test_impossible_pin_is_one_line_exit_2(tmp_path):
    cfg = tmp_path / "job.toml"
    cfg.write_text(BASE)
    for overrides, message in (
        (["parallel.tp=3"], "parallel.tp: 3 does not divide the model's 32 attention heads"),
        (["parallel.pp=64"], "parallel.pp: 64 pipeline stages for 32 layers"),
        (["parallel.tp=8", "parallel.pp=4"], "does not divide the 16 GPUs"),
        (["parallel.tpp=2"], "parallel.tpp: unknown key"),
    ):
        r = CliRunner().invoke(main, ["plan", str(cfg), *overrides, "--gpus", "16"])
        assert r.exit_code == 2 and r.stdout == "", r.output
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("scaletrain: error: ") and message in lines[0], r.stderr


FULL = [
    "parallel.dp_replicate=1",
    "parallel.dp_shard=16",
    "parallel.tp=1",
    "parallel.pp=1",
    "parallel.activation_checkpoint=none",
    "train.micro_batch_size=4",
    "precision.dtype=bf16",
]


def test_fully_pinned_layout_is_evaluated_even_when_it_does_not_fit(tmp_path):
    data = plan_json(tmp_path, FULL)
    search = plan_json(tmp_path, FULL[:2])
    assert set(data) == set(search)  # one schema for both
    assert data["evaluated"] and len(data["layouts"]) == 1
    row = data["layouts"][0]
    assert row["fits"] is False and row["memory_bytes"]["total"] > 80e9
    assert row["layout"]["dp_shard"] == 16 and row["layout"]["micro_batch"] == 4
    assert any(line.startswith("does not fit: needs") for line in data["why"])
    assert data["nearest"] and all(n["fits"] for n in data["nearest"])
    # the nearest change as few choices as possible: the first keeps fsdp 16 and only checkpoints or shrinks
    first = data["nearest"][0]["layout"]
    assert (first["dp_shard"], first["tp"], first["pp"]) == (16, 1, 1)

    cfg = tmp_path / "job.toml"
    text = CliRunner().invoke(main, ["plan", str(cfg), *FULL, "--gpus", "16"])
    assert text.exit_code == 0, text.output
    assert "does NOT fit" in text.stdout and "nearest layouts that fit" in text.stdout


def test_fully_pinned_fitting_layout_and_world_from_the_pins(tmp_path):
    # no --gpus: the four degrees give the world size
    over = [*FULL[:1], "parallel.dp_shard=4", "parallel.tp=4", *FULL[3:5], "train.micro_batch_size=1", FULL[6]]
    data = plan_json(tmp_path, over, ["--gpu", "h100-sxm", "--json"])
    assert data["cluster"]["gpus"] == 16 and data["evaluated"]
    row = data["layouts"][0]
    assert row["fits"] and row["layout"]["tp"] == 4 and row["layout"]["accumulation"] == 16
    assert all(x["time_s"]["step"] < row["time_s"]["step"] for x in data["nearest"])
