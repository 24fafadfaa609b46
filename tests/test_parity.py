"""Loss parity across layouts (fp32, CPU ranks over gloo): one process, DDP 2, FSDP2 2, HSDP 2x2 and gradient
accumulation all see the same global batch and must produce the same per-step loss.
One process, FSDP2 and HSDP are real `scaletrain train` launches and DDP runs it under an external torchrun; FSDP2
without resharding and accumulation share one 2-rank launch of tests/parallel_runner.py, and the second run of the
one-process job is a plain process of it: both train with the trainer's own loop (the `fit` that `scaletrain train`
runs in each rank), which writes the same metrics.jsonl."""

import pytest

from conftest import FAST, losses, run_cli, torchrun, val_losses
from test_parallel_layouts import launch_runner

TOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("parity")
    cli = {
        "single": (["--nproc-per-node", "1"], []),
        "fsdp": ([], []),
        "hsdp": (["--nproc-per-node", "4"], ["parallel.dp_replicate=2"]),
    }
    for name, (flags, extra) in cli.items():
        run_cli(["train", *FAST, f"run.name={name}", *extra, *flags], cwd)
    # DDP under an external torchrun: `scaletrain train` runs as the rank it was started as
    torchrun(2, ["-m", "scaletrain.cli.main", "train", *FAST, "run.name=ddp", "parallel.dp_replicate=2"], cwd=cwd)
    shared = {
        "fsdp_zero2": ["parallel.fsdp_reshard_after_forward=false"],
        "accum4": ["train.micro_batch_size=2"],  # 2 ranks x 4 micro-batches of 2 = 16
    }
    run = [f"run.output_dir={cwd / 'runs'}"]
    launch_runner(2, {n: [*run, f"run.name={n}", *o] for n, o in shared.items()}, cwd / "runner", fit=frozenset(shared))
    launch_runner(1, {"single_again": [*run, "run.name=single_again"]}, cwd / "runner", fit=frozenset({"single_again"}))
    return {name: cwd / "runs" / name for name in [*cli, "ddp", *shared, "single_again"]}


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "fsdp_zero2", "hsdp", "accum4"])
def test_per_step_loss_matches_one_process(runs, layout):
    ref, got = losses(runs["single"]), losses(runs[layout])
    assert len(ref) == len(got) == 10
    for step, (a, b) in enumerate(zip(ref, got), 1):
        assert abs(a - b) <= TOL, f"{layout} step {step}: {b} vs single-process {a}"
    assert abs(val_losses(runs["single"])[-1] - val_losses(runs[layout])[-1]) <= TOL


def test_same_config_same_losses_run_to_run(runs):
    assert losses(runs["single"]) == losses(runs["single_again"])


def test_loss_falls(runs):
    got = losses(runs["fsdp"])
    assert got[-1] < got[0] - 1.0
