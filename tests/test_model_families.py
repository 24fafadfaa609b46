"""A model family is one folder: tests/model_families/mlp_lm/ (a 2-block MLP-only LM, nothing in scaletrain names
it) trains under DDP, FSDP and PP through the normal trainer with the losses and final weights of one process,
and the CLI lists, trains, checkpoints and exports it."""

import json
import os
from pathlib import Path

import pytest
import torch

from conftest import FAST, losses, run_cli, run_cli_in_process
from test_parallel_layouts import launch_runner, runner_losses, runner_state

FAMILIES = str(Path(__file__).resolve().parent / "model_families")
TOL = 1e-5
LAYOUTS = {
    "ddp2": ["parallel.dp_replicate=2", "parallel.dp_shard=1"],
    "fsdp2": [],
    "pp2": ["parallel.pp=2", "parallel.dp_shard=1", "parallel.pp_schedule=GPipe"],
}


@pytest.fixture(scope="module")
def mlp_runs(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("families")
    out = cwd / "runner"
    model = ["model.name=mlp-tiny"]
    os.environ["SCALETRAIN_MODEL_PATH"] = FAMILIES  # inherited by the launches below
    try:
        launch_runner(1, {"single": [*model, "parallel.dp_shard=1"]}, out)
        launch_runner(2, {name: [*model, *extra] for name, extra in LAYOUTS.items()}, out)
    finally:
        del os.environ["SCALETRAIN_MODEL_PATH"]
    return out


@pytest.mark.slow  # one launch per layout; the new family still trains through the CLI in the fast tier
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_new_family_trains_under_every_data_and_pipeline_layout(mlp_runs, layout):
    ref, got = runner_losses(mlp_runs / "single"), runner_losses(mlp_runs / layout)
    assert len(ref) == len(got) == 10 and ref[-1] < ref[0] - 0.5  # it learns
    for step, (a, b) in enumerate(zip(ref, got), 1):
        assert abs(a - b) <= TOL, f"{layout} step {step}: {b} vs single-process {a}"
    ref_state, got_state = runner_state(mlp_runs / "single"), runner_state(mlp_runs / layout)
    assert sorted(got_state) == sorted(ref_state) and "blocks.1.up.weight" in ref_state
    worst = max((got_state[k] - ref_state[k]).abs().max().item() for k in ref_state)
    assert worst <= TOL, f"{layout}: a parameter differs by {worst}"


def test_the_cli_lists_trains_checkpoints_and_exports_a_new_family(tmp_path, monkeypatch):
    # one launch; the commands that start no rank run in this process (the family is found the same way)
    env = {"SCALETRAIN_MODEL_PATH": FAMILIES}
    monkeypatch.setenv("SCALETRAIN_MODEL_PATH", FAMILIES)
    assert "mlp-tiny" in run_cli_in_process(["models"], tmp_path).stdout
    run_cli(
        ["train", *FAST, "model.name=mlp-tiny", "run.name=mlp", "checkpoint.save_final=true", "--nproc-per-node", "1"],
        tmp_path,
        env=env,
    )
    assert len(losses(tmp_path / "runs/mlp")) == 10
    ckpt = tmp_path / "runs/mlp/checkpoints/step_00000010"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["model_spec"]["family"] == "mlp-lm"
    run_cli_in_process(["ckpt", "export", str(ckpt), "--out", str(tmp_path / "st")], tmp_path)
    from safetensors.torch import load_file

    assert load_file(str(tmp_path / "st/model.safetensors"))["blocks.0.up.weight"].shape == torch.Size([256, 64])
    proc = run_cli_in_process(
        ["ckpt", "export", str(ckpt), "--format", "hf", "--out", str(tmp_path / "hf")], tmp_path, check=False
    )
    assert proc.returncode == 2 and proc.stderr.strip().endswith("has no Hugging Face counterpart")
    assert not (tmp_path / "hf").exists()
    proc = run_cli_in_process(
        ["train", "model.name=mlp-tiny", "parallel.tp=2", "--nproc-per-node", "2"], tmp_path, check=False
    )
    assert proc.returncode == 2 and "has no tensor-parallel plan" in proc.stderr
