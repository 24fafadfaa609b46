"""`scaletrain plan` and `scaletrain bench` as a user runs them: tables, JSON, exit codes, files written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from scaletrain.cli.main import main

PLAN_8B = [
    "plan",
    "--model",
    "llama-8b",
    "--gpus",
    "64",
    "--gpu",
    "h100-sxm",
    "--interconnect",
    "nvlink4,ib-ndr",
    "--seq-len",
    "8192",
    "--global-batch",
    "512",
]


def run(args):
    return CliRunner().invoke(main, args, catch_exceptions=False)


def test_plan_prints_ranked_table_and_explanations():
    r = run(PLAN_8B)
    assert r.exit_code == 0, r.output
    for text in (
        "layout",
        "mem/GPU GB",
        "step s",
        "tokens/s",
        "MFU",
        "bubble %",
        "comm %",
        "why #1",
        "why not the alternatives",
        "crosses nodes over ib-ndr",
        "run #1 with: parallel.dp_replicate=",
        "one h100-sxm",
        "CUDA context",
    ):
        assert text in r.output, text


def test_plan_json():
    r = run(PLAN_8B + ["--json", "--tokens", "1T"])
    assert r.exit_code == 0
    data = json.loads(r.output)
    top = data["layouts"][0]
    assert top["fits"] and top["memory_bytes"]["total"] <= 80e9
    assert set(top["memory_bytes"]) >= {
        "parameters",
        "gradients",
        "optimizer states",
        "activations",
        "CUDA context",
        "comm buffers",
        "fragmentation",
    }
    assert "parallel.dp_shard=" in top["layout"]["overrides"]
    assert data["budget"]["gpu_hours"] > 0 and data["budget"]["energy_kwh"] > 0
    assert data["why"] and data["alternatives"] and data["advice"]


def test_compare_gpus_for_a_token_budget():
    r = run(
        [
            "plan",
            "--model",
            "llama-8b",
            "--gpus",
            "64",
            "--tokens",
            "1T",
            "--precision",
            "bf16",
            "--compare-gpus",
            "h100-sxm,l40s,a100-80gb",
            "--json",
        ]
    )
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["compare"]
    assert [x["gpu"] for x in rows] == ["h100-sxm", "l40s", "a100-80gb"]
    for x in rows:
        assert x["time_to_train_s"] > 0 and x["gpu_hours"] > 0 and x["cost_usd"] > 0 and x["energy_kwh"] > 0
        assert x["node_kw"] > 0
    table = run(["plan", "--gpus", "64", "--tokens", "1T", "--compare-gpus", "h100-sxm,l40s"])
    assert table.exit_code == 0 and "time to train" in table.output and "kW/node" in table.output


def test_custom_size_and_cluster_file(tmp_path):
    f = tmp_path / "lab.toml"
    f.write_text(
        'gpu = "my-gpu"\ngpus_per_node = 4\nnodes = 4\nintra_node_link = "pcie5"\n'
        'inter_node_link = "roce-400"\nusd_per_gpu_hour = 1.5\npue = 1.2\n'
        "[gpu_types.my-gpu]\nmemory_gb = 96\nmemory_bw_tbs = 3.0\nbf16_tflops = 500\npower_w = 500\n"
        'source = "test figures"\n'
    )
    r = run(["plan", "--params", "13B", "--cluster", str(f), "--seq-len", "4096", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["cluster"] == {
        **data["cluster"],
        "gpu": "my-gpu",
        "gpus": 16,
        "nodes": 4,
        "intra_link": "pcie5",
        "inter_link": "roce-400",
    }
    assert 12e9 < data["model"]["params"] < 14e9


BAD = [
    (["plan", "--gpus", "0"], "--gpus: must be 1 to 65,536"),
    (["plan", "--gpus", "8", "--gpu", "h900"], "--gpu: unknown GPU 'h900'"),
    (["plan", "--gpus", "8", "--interconnect", "ib-ndr,nvlink4"], "--interconnect:"),
    (["plan", "--gpus", "12"], "not a whole number of 8-GPU nodes"),
    (["plan", "--gpus", "8", "--model", "gpt-5"], "--model: unknown model"),
    (["plan", "--gpus", "8", "--params", "lots"], "--params: expected a number"),
    (["plan", "--gpus", "8", "--compare-gpus", "l40s"], "--compare-gpus: needs a token budget"),
    (["plan", "--gpus", "8", "--gpu", "rtx-4090", "--params", "1e15"], "does not fit"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[b[1][:30] for b in BAD])
def test_impossible_requests_fail_in_one_line(args, message):
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scaletrain: error: ") and message in lines[0], r.stderr


@pytest.mark.parametrize(
    "text,message",
    [
        ('gpu = "h100-sxm"\ngpus_per_node = 8\nnodse = 2\n', "nodse: unknown key"),
        ('gpu = "h100-sxm"\ngpus_per_node = "8"\n', "gpus_per_node"),
        ('gpu = "h100-sxm"\ngpus_per_node = 8\n[', "not valid TOML"),
        ('gpu = "tpu-v9"\ngpus_per_node = 8\n', "gpu: unknown GPU"),
        ('gpu = "h100-sxm"\ngpus_per_node = 8\ninter_node_link = "nvlink4"\n', "intra_node_link/inter_node_link"),
        (
            'gpu = "x"\ngpus_per_node = 8\n[gpu_types.x]\nmemory_gb = 80\nmemory_bw_tbs = 1\nbf16_tflops = 100\n'
            "power_w = 300\n",
            "gpu_types.x.source",
        ),
        (
            'gpu = "x"\ngpus_per_node = 8\n[gpu_types.x]\nmemory_gb = 80\nmemory_bw_tbs = 1\nbf16_tflops = 100\n'
            'power_w = 300\nsource = "me"\nmemroy_gb = 1\n',
            "gpu_types.x.memroy_gb: unknown key; valid keys here: memory_gb",
        ),
    ],
)
def test_bad_cluster_files(tmp_path, text, message):
    f = tmp_path / "c.toml"
    f.write_text(text)
    r = CliRunner().invoke(main, ["plan", "--cluster", str(f)])
    assert r.exit_code == 2 and r.stdout == ""
    line = r.stderr.strip()
    assert "\n" not in line and line.startswith("scaletrain: error: cluster file") and message in line, line
    missing = CliRunner().invoke(main, ["plan", "--cluster", str(tmp_path / "none.toml")])
    assert missing.exit_code == 2 and "not found" in missing.stderr


@pytest.mark.slow  # a minute of measuring on gloo ranks; reading a calibration file stays fast (test_plan_calibration.py)
def test_bench_writes_calibration_the_planner_uses(tmp_path):
    cal = tmp_path / "cal.toml"
    # a real process: bench spawns gloo ranks of its own
    p = subprocess.run(
        [sys.executable, "-m", "scaletrain.cli.main", "bench", "-o", str(cal), "--size-mb", "1", "--matmul-n", "256"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert "all-reduce busbw" in p.stdout and "all-gather" in p.stdout and "per dispatched op" in p.stdout
    from scaletrain.hardware.kernels import ATTENTION_POINTS
    from scaletrain.hardware.calibration import load_calibration

    measured = load_calibration(cal)
    assert 0 < measured.op_overhead_s < 1e-3  # seconds per op: microseconds, not milliseconds
    # the curves: several GEMM shapes, copy sizes and message sizes up to --size-mb, and their fit
    assert len(measured.matmul) >= 6 and len(measured.copy) >= 3
    assert [b for b, _ in measured.all_reduce][-1] == 2**20 and len(measured.all_gather) == len(measured.all_reduce)
    assert measured.allreduce_latency_s is not None and measured.allgather_busbw > 0
    assert len(measured.reduce_scatter) == len(measured.all_reduce) and measured.reducescatter_busbw > 0
    assert "reduce-scatter" in p.stdout
    # a CPU host: its usable cores and the wait of a collective amid compute at each measured gap
    assert measured.host_cores >= 1 and len(measured.collective_amid_compute) == 4 and "cores" in p.stdout
    # causal attention forward + backward at every (seq, head dim) point, and a real step measured op by op: its
    # GEMMs by shape, its attention at the model's sequence and head dim, its memory-bound ops' bandwidth
    assert [(s, d) for s, d, _ in measured.attention] == [tuple(map(float, p)) for p in ATTENTION_POINTS["cpu"]]
    assert len(measured.step_matmul) >= 7 and [(s, d) for s, d, _ in measured.step_attention] == [(256.0, 32.0)]
    assert measured.step_pointwise_bw > 0 and "attention" in p.stdout and "memory-bound ops" in p.stdout
    r = run(
        [
            "plan",
            "--model",
            "tiny",
            "--gpu",
            "cpu",
            "--gpus",
            "2",
            "--calibration",
            str(cal),
            "--seq-len",
            "256",
            "--global-batch",
            "16",
            "--json",
        ]
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["cluster"]["calibration"].startswith("calibrated on")
    wrong = CliRunner().invoke(main, ["plan", "--gpus", "8", "--calibration", str(cal)])
    assert wrong.exit_code == 2 and "measured on 'cpu'" in wrong.stderr
    before = sorted(tmp_path.iterdir())
    for flags in (["--nproc", "0"], ["--matmul-n", "8"], ["--size-mb", "nan"]):
        bad = CliRunner().invoke(main, ["bench", "-o", str(tmp_path / "x.toml"), *flags])
        assert bad.exit_code == 2 and bad.stderr.count("\n") == 1, (flags, bad.output)
    assert sorted(tmp_path.iterdir()) == before  # nothing written


def test_plan_of_a_hugging_face_folder_and_its_refusal_under_the_flag_name(tmp_path):
    """`plan --hf DIR` plans the folder's architecture; a bad folder is one line naming --hf (the model's own
    check raised it for model.hf), exit 2."""
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 128,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    r = run(["plan", "--hf", str(tmp_path), "--gpus", "2", "--gpu", "h100-sxm", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["model"]["name"] == "LlamaForCausalLM"
    r = run(["plan", "--hf", str(tmp_path / "missing"), "--gpus", "2"])
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == [
        f"scaletrain: error: --hf: {str(tmp_path / 'missing')!r} is not a folder; point it at a local Hugging Face "
        "model folder"
    ]
