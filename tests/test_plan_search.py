"""The search: ranked layouts that fit, the overrides they print, and its speed at scale."""

from __future__ import annotations


import pytest

from scaletrain.config import ConfigError, JobConfig, load_config, parse_override
from scaletrain.hardware import make_cluster
from scaletrain.models import preset_spec
from scaletrain.plan import Layout, SearchOptions, Workload, evaluate_layout, search_layouts, smallest_setup
from scaletrain.plan.advice import budget_for, compare_gpus, fits_on
from scaletrain.plan.explain import explain_alternatives, explain_top
from scaletrain.plan.shapes import decoder_shape_for_params

W8B = Workload("llama-8b", preset_spec("llama-8b").shape(), 8192, 512)
H100_64 = make_cluster("h100-sxm", 64, "nvlink4,ib-ndr")


def test_llama_8b_on_64_h100_ranked_fitting_and_explained():
    res = search_layouts(W8B, H100_64)
    assert res.rows and res.fitting > 0
    steps = [r.step_s for r in res.rows]
    assert steps == sorted(steps)
    for r in res.rows:
        assert r.fits and r.memory_total <= 80e9
        assert r.layout.world_size == 64
        assert r.layout.dp * r.layout.micro_batch * r.layout.accumulation == 512
        assert 0 < r.mfu < 1 and 0 <= r.bubble_share < 1 and 0 <= r.comm_share < 1
        assert sum(r.memory.values()) == pytest.approx(r.memory_total)
        assert sum(r.time.values()) == pytest.approx(r.step_s)
    assert res.rows[0].layout.tp <= 8  # tensor parallelism never leaves the NVLink domain at the top
    assert any("crosses nodes over ib-ndr" in line for line in explain_alternatives(res))
    assert explain_top(res)[0].startswith(res.rows[0].layout.describe())


def test_overrides_are_job_config_keys():
    lay = Layout(2, 16, 2, 1, 1, 2, 8, "selective", "bf16", "none")
    parsed = dict((".".join(k), v) for k, v in map(parse_override, lay.as_overrides().split()))
    assert parsed["parallel.dp_shard"] == 16 and parsed["parallel.tp"] == 2
    assert parsed["train.micro_batch_size"] == 2 and parsed["precision.dtype"] == "bf16"
    assert parsed["train.global_batch_size"] == 2 * 8 * 32


@pytest.mark.parametrize(
    "lay",
    [
        Layout(2, 16, 2, 1, 1, 2, 8, "selective", "bf16", "none"),
        Layout(1, 2, 1, 4, 1, 1, 16, "full", "fp32", "ZBVZeroBubble", 2),
        Layout(4, 1, 1, 1, 1, 4, 1, "none", "fp16", "none"),
    ],
)
def test_a_layout_applies_to_a_config_as_its_printed_overrides_would(lay):
    base = load_config(None, ["train.steps=7"])
    applied = lay.apply(base)
    assert applied == load_config(None, ["train.steps=7", *lay.as_overrides().split()])
    assert (applied.parallel.tp, applied.parallel.pp, applied.precision.dtype) == (lay.tp, lay.pp, lay.precision)
    assert applied.train.steps == 7 and base.parallel.tp == 1  # the rest kept, the original untouched


def test_a_layout_the_config_refuses_is_one_line_naming_the_field():
    with pytest.raises(ConfigError, match=r"^train\.global_batch_size: "):
        Layout(1, 4, 1, 1, 1, 2**25, 1, "none", "bf16", "none").apply(JobConfig())


def test_a_context_parallel_layout_applies_with_the_method_the_planner_models():
    applied = Layout(1, 4, 1, 1, 2, 1, 4, "none", "bf16", "none").apply(JobConfig())
    assert (applied.parallel.cp, applied.parallel.cp_method, applied.parallel.dp_shard) == (2, "allgather", 4)


def test_pipeline_bubble_shows_in_a_given_layout():
    lay = Layout(1, 8, 1, 8, 1, 1, 64, "full", "bf16", "1F1B")
    row = evaluate_layout(W8B, H100_64, lay)
    per_micro_batch = sum(row.time[k] for k in ("compute", "recompute", "tp comm", "cp comm", "pp p2p"))
    # 1F1B: bubble = (p-1)/m of the pipeline's work (FSDP's exposed per-micro-batch gathers add a little)
    assert row.time["bubble"] / per_micro_batch == pytest.approx(7 / 64, rel=2e-2)
    gpipe = evaluate_layout(W8B, H100_64, Layout(1, 8, 1, 8, 1, 1, 64, "full", "bf16", "GPipe"))
    assert gpipe.memory["activations"] > row.memory["activations"] * 7  # GPipe keeps all 64 micro-batches


def test_trillion_parameters_on_3072_gpus():
    work = Workload("1t", decoder_shape_for_params(1e12), 8192, 3072)
    assert 0.95e12 < work.args.num_params() < 1.05e12
    cluster = make_cluster("h100-sxm", 3072, "nvlink4,ib-ndr")
    res = search_layouts(work, cluster)  # its speed is benchmarks/ territory, not an assertion
    assert res.searched > 10_000 and res.rows
    top = res.rows[0]
    # TP stays in the node; with gradients sharded while accumulating, FSDP over 3072 ranks may hold a trillion
    # parameters without a pipeline (16 bytes per parameter / the shard degree)
    assert top.layout.tp <= 8 and top.fits
    assert top.layout.pp > 1 or top.layout.dp_shard >= 256


def test_does_it_fit_on_one_gpu_and_smallest_setup():
    one = fits_on(Workload("llama-1b", preset_spec("llama-1b").shape(), 2048, 32), H100_64.with_gpus(1))
    assert one.fits and "fits" in one.reason
    big = fits_on(W8B, H100_64.with_gpus(1))
    assert not big.fits and "exceed" in big.reason
    smallest = smallest_setup(W8B, H100_64)
    assert smallest is not None and 1 < smallest.gpus <= 8


def test_token_budget_and_gpu_comparison():
    opts = SearchOptions(precisions=("bf16",))
    b = budget_for(search_layouts(W8B, H100_64, opts), 1e12)
    assert b.time_to_train_s == pytest.approx(1e12 / b.tokens_per_s)
    assert b.gpu_hours == pytest.approx(64 * b.time_to_train_s / 3600)
    assert b.node_kw == pytest.approx((8 * 700 * 1.8) / 1e3)  # GPUs + 0.8 x GPU power of node overhead
    rows = compare_gpus(W8B, ["h100-sxm", "l40s", "a100-80gb"], 64, 1e12, opts)
    assert [r.gpu for r in rows] == ["h100-sxm", "l40s", "a100-80gb"]
    assert all(r.fits for r in rows)
    assert rows[0].tokens_per_s > rows[2].tokens_per_s > rows[1].tokens_per_s
