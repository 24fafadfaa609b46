"""Checkpoints and recovery, with real launches: SIGKILL of a rank mid-run (bit-identical result), preemption
by SIGUSR1 then resume on another layout and world size, a corrupted newest checkpoint and a crashed save
(fallback), and the ckpt ls / verify / export commands (HF export loaded by transformers)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from conftest import losses, run_cli, run_cli_in_process, val_losses
from scaletrain.checkpoint.export import load_full_model_state
from scaletrain.monitor import read_jsonl

STEPS = 40  # checkpoints every 10: the newest, the one before it and a good one below (test_corrupt_...)
JOB = [
    f"train.steps={STEPS}",
    "monitor.log_interval=1",
    "train.global_batch_size=16",
    "data.seq_len=64",
    "train.eval_batches=1",
    "train.eval_interval=0",
    "data.max_bytes=300000",
    "train.warmup_steps=5",
    "monitor.progress=false",
    "checkpoint.interval_steps=10",
    "checkpoint.save_final=true",
]


def _start(args, cwd):
    return subprocess.Popen(
        [sys.executable, "-m", "scaletrain.cli.main", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_step(run: Path, step: int, proc, timeout=240.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"run ended before step {step}: {proc.stderr.read()[-3000:]}")
        path = run / "metrics.jsonl"
        if path.is_file():
            steps = [json.loads(x).get("step", 0) for x in path.read_text().splitlines() if x.endswith("}")]
            if steps and max(steps) >= step:
                return max(steps)
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def _workers(run: Path, nproc: int = 2, timeout: float = 60.0) -> list[int]:
    """The pids of a run's rank processes, in rank order, from their heartbeat records (train/watchdog.py: each rank
    writes its pid there as it starts). Not from the process tree: the ranks are children of a forkserver beside
    their checkpoint writers, and a pid order is no rank order once pids wrap around."""
    from scaletrain.train.watchdog import read_heartbeats

    deadline = time.monotonic() + timeout
    while True:
        beats = {b["rank"]: b["pid"] for b in read_heartbeats(run / "heartbeat")}
        pids = [beats[r] for r in range(nproc) if r in beats and psutil.pid_exists(beats[r])]
        if len(pids) == nproc or time.monotonic() > deadline:
            return pids
        time.sleep(0.05)


def _final_weights(run: Path) -> dict:
    state, _ = load_full_model_state(run / "checkpoints" / f"step_{STEPS:08d}")
    return state


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("ckpt")
    run_cli(["train", *JOB, "run.name=clean"], cwd)
    return cwd, cwd / "runs" / "clean"


@pytest.mark.slow  # a launch and a restart; resume bit for bit stays fast (test_corrupt_and_crafted_...)
def test_sigkill_of_a_rank_recovers_bit_identical(clean):
    cwd, ref = clean
    proc = _start(["train", *JOB, "run.name=killed", "launch.max_restarts=2"], cwd)
    reached = _wait_for_step(cwd / "runs/killed", 14, proc)
    victims = _workers(cwd / "runs/killed")
    assert len(victims) == 2, victims
    os.kill(victims[-1], signal.SIGKILL)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "resumed from" in err, err[-3000:]
    # one line for the kill, pointing at the rank's log; no torch elastic traceback
    assert (
        "scaletrain: restarting the worker group (restart 1 of 2) after a failure on rank 1 (exit -9, killed "
        "by SIGKILL); full log: runs/killed/logs/rank1.log" in err
    ), err[-3000:]
    assert "Traceback" not in err and "ProcessExitedException" not in err, err[-3000:]
    assert reached < STEPS
    got, want = _final_weights(cwd / "runs/killed"), _final_weights(ref)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert losses(cwd / "runs/killed") == losses(ref)  # the replayed steps' records replace the lost ones


@pytest.mark.slow  # a 4-rank and a 2-rank launch; resume bit for bit stays fast (test_corrupt_and_crafted_...)
def test_preempt_then_resume_on_another_layout_and_world_size(clean):
    cwd, ref = clean
    run = cwd / "runs/moved"
    proc = _start(["train", *JOB, "run.name=moved", "--nproc-per-node", "4"], cwd)  # FSDP on 4 ranks
    _wait_for_step(run, 15, proc)
    proc.send_signal(signal.SIGUSR1)  # what Slurm's --signal=B:USR1@N delivers
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    stopped_at = int(saved[-1].split("_")[1])
    assert stopped_at < STEPS and max(r["step"] for r in read_jsonl(run / "metrics.jsonl")) == stopped_at
    # continue with DDP on 2 ranks: model, optimizer and data position carry over
    proc2 = run_cli(["train", *JOB, "run.name=moved", "parallel.dp_replicate=2"], cwd)
    assert f"resumed from {run / 'checkpoints' / saved[-1]}".replace(str(cwd) + "/", "") in proc2.stderr
    stitched, want = losses(run), losses(ref)
    assert len(stitched) == len(want) == STEPS
    for step, (a, b) in enumerate(zip(want, stitched), 1):
        assert abs(a - b) <= 1e-5, f"step {step}: {b} vs uninterrupted {a}"
    assert abs(val_losses(run)[-1] - val_losses(ref)[-1]) <= 1e-5


class _Payload:
    """Unpickling this runs a shell command: what a crafted DCP `.metadata` can do to torch's plain pickle.load."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant_pickle(ckpt: Path, marker: Path) -> None:
    """Rewrite ckpt/.metadata to run a command when unpickled, and its manifest entry to match, as someone who
    can write the folder could."""
    import pickle

    from scaletrain.checkpoint.manifest import sha256_file

    meta = pickle.loads((ckpt / ".metadata").read_bytes())  # our own file: trusted here
    meta.planner_data = _Payload(marker)
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][".metadata"] = {
        "bytes": (ckpt / ".metadata").stat().st_size,
        "sha256": sha256_file(ckpt / ".metadata"),
    }
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def test_corrupt_and_crafted_checkpoints_are_refused_and_work_is_not_lost(clean):
    """Newest checkpoint corrupted (a flipped byte), the one before it carrying a pickle that runs a command, a
    save that crashed before committing: verify, ls and export refuse them without running anything; resume sets
    both aside, falls back to the last good one, and saves the retrained steps (the final one verifies and equals
    the clean run's bit for bit)."""
    cwd, ref = clean
    run = cwd / "runs/damaged"
    ckpts = run / "checkpoints"
    shutil.copytree(ref / "checkpoints", ckpts)
    newest = ckpts / f"step_{STEPS:08d}"
    shard = sorted(newest.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))  # same size, one flipped byte
    crafted = ckpts / f"step_{STEPS - 10:08d}"
    marker = cwd / "PWNED"
    _plant_pickle(crafted, marker)
    (ckpts / f"step_{STEPS + 10:08d}.partial").mkdir()  # a save that crashed before committing

    # a fresh interpreter once; the other ckpt commands run in this process (run_cli_in_process)
    proc = run_cli(["ckpt", "verify", str(run)], cwd, check=False)
    assert proc.returncode == 1
    assert f"step_{STEPS:08d}: BAD: {shard.name} fails its sha256 checksum" in proc.stdout
    assert (
        f"step_{STEPS - 10:08d}: BAD: step_{STEPS - 10:08d}/.metadata: refuses to unpickle posix.system" in proc.stdout
    ), proc.stdout
    listing = run_cli_in_process(["ckpt", "ls", str(run)], cwd).stdout
    assert "incomplete" in listing and "sizes ok, not verified" in listing
    listing = run_cli_in_process(["ckpt", "ls", "--verify", str(run)], cwd).stdout
    assert "fails its sha256" in listing and "refuses to unpickle" in listing and "verified (sha256" in listing
    proc = run_cli_in_process(["ckpt", "export", str(crafted), "--out", str(cwd / "exported")], cwd, check=False)
    assert proc.returncode == 2 and "refuses to unpickle posix.system" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 2  # "skipping ..." and the one-line error
    assert not (cwd / "exported").exists()
    assert not marker.exists()

    proc = run_cli(["train", *JOB, "run.name=damaged"], cwd)
    assert f"skipping step_{STEPS:08d}" in proc.stderr and "set aside as" in proc.stderr
    assert f"skipping step_{STEPS - 10:08d}" in proc.stderr and "refuses to unpickle" in proc.stderr
    assert f"step_{STEPS - 20:08d} at step {STEPS - 20}" in proc.stderr
    assert not marker.exists()
    assert not (ckpts / f"step_{STEPS + 10:08d}.partial").exists()
    assert losses(run) == losses(ref)[STEPS - 20 :]  # only the replayed steps were logged in this run
    # the retrained steps were saved again: the newest checkpoint verifies and holds the clean run's weights
    assert run_cli_in_process(["ckpt", "verify", str(newest)], cwd).stdout.strip() == f"step_{STEPS:08d}: ok"
    assert {p.name.split(".")[0] for p in ckpts.glob("*.corrupt-*")} == {newest.name, crafted.name}
    listing = run_cli_in_process(["ckpt", "ls", str(run)], cwd).stdout
    assert listing.count("set aside") == 2
    mine, theirs = _final_weights(run), _final_weights(ref)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_export_hf_loads_in_transformers_and_imports_back(clean, tmp_path):
    transformers = pytest.importorskip("transformers")
    cwd, ref = clean
    out = tmp_path / "hf"
    run_cli_in_process(["ckpt", "export", str(ref), "--format", "hf", "--out", str(out)], cwd)
    for fmt in ("safetensors", "torch"):
        run_cli_in_process(["ckpt", "export", str(ref), "--format", fmt, "--out", str(tmp_path / fmt)], cwd)
    bad = run_cli_in_process(
        ["ckpt", "export", str(ref), "--out", str(tmp_path / "x"), "--max-shard-size", "2 big"], cwd, check=False
    )
    assert bad.returncode == 2 and bad.stderr.strip().endswith("write it like 2GB, 500MB or 1GiB")
    assert len(bad.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()
    state, spec = load_full_model_state(ref / "checkpoints" / f"step_{STEPS:08d}")
    plain = torch.load(tmp_path / "torch" / "model.pt", weights_only=True)
    assert all(torch.equal(plain[k], state[k]) for k in state)

    ours = spec.build("cpu")
    ours.load_state_dict(state)
    spec.init_buffers(ours)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), atol=1e-4, rtol=1e-4)

    # start a new run from the exported Hugging Face weights: the first loss is that of a trained model
    proc = run_cli(
        [
            "train",
            "train.steps=2",
            "data.seq_len=64",
            "data.max_bytes=300000",
            "monitor.log_interval=1",
            "train.eval_batches=1",
            "run.name=imported",
            f"checkpoint.init_from_hf={out}",
            "--nproc-per-node",
            "1",
        ],
        cwd,
    )
    assert "initial weights from Hugging Face" in proc.stderr
    assert losses(cwd / "runs/imported")[0] < losses(ref)[0] - 1.0


@pytest.mark.slow  # its own launches; a non-finite step's skip/stop is unit-tested in test_train_units.py
def test_non_finite_loss_stops_or_skips(tmp_path):
    base = [
        "train",
        "train.steps=6",
        "data.seq_len=64",
        "data.max_bytes=300000",
        "monitor.log_interval=1",
        "train.eval_batches=1",
        "train.lr=1e30",
        "train.warmup_steps=0",
        "train.grad_clip=0",
        "--nproc-per-node",
        "1",
    ]
    proc = run_cli([*base, "run.name=stop"], tmp_path, check=False)
    assert proc.returncode == 1
    # one line naming what was not finite, with the rank's log (which keeps the traceback); no tracebacks here
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("scaletrain: training failed on rank 0 (exit 1): NonFiniteError: step "), last
    assert "is not finite (loss " in last and "train.nan_policy=stop" in last, last
    assert last.endswith("; full log: runs/stop/logs/rank0.log"), last
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "Traceback" in (tmp_path / "runs/stop/logs/rank0.log").read_text()
    proc = run_cli(
        [*base, "run.name=skip", "train.nan_policy=skip", "train.max_skipped_steps=2"], tmp_path, check=False
    )
    assert proc.returncode == 1
    warning = next(line for line in proc.stderr.splitlines() if "update skipped (1/2)" in line)
    # the loss of step 1 is finite and its gradient norm is not: the warning says which, with both values
    assert "gradient norm is not finite (loss " in warning and "gradient norm nan" in warning, warning
    assert "3 step(s) skipped" in proc.stderr and "Traceback" not in proc.stderr


def _resume_copy(src: Path, dst: Path, upto: int) -> None:
    """A run folder holding src's checkpoints up to step `upto` (as if it had stopped there)."""
    for p in (src / "checkpoints").iterdir():
        if int(p.name.split("_")[1]) <= upto:
            shutil.copytree(p, dst / "checkpoints" / p.name)


@pytest.mark.slow  # 3 more launches; resuming on another layout is test_preempt_then_resume_on_another_layout_and_world_size
def test_pipeline_checkpoints_load_into_fsdp_and_back(clean):
    cwd, ref = clean
    run_cli(["train", *JOB, "run.name=pp", "parallel.pp=2", "parallel.dp_shard=1", "checkpoint.keep=0"], cwd)
    pp = cwd / "runs/pp"
    want, got = losses(ref), losses(pp)
    assert len(want) == len(got) == STEPS  # a truncated run must not pass the comparisons below
    assert all(abs(a - b) <= 1e-5 for a, b in zip(want, got))
    # pipeline-parallel checkpoint (stage-local names) -> FSDP on 2 ranks
    _resume_copy(pp, cwd / "runs/pp_to_fsdp", STEPS - 20)
    proc = run_cli(["train", *JOB, "run.name=pp_to_fsdp"], cwd)
    assert f"at step {STEPS - 20} (saved by" in proc.stderr and "pp=2" in proc.stderr
    resumed = losses(cwd / "runs/pp_to_fsdp")
    assert len(resumed) == 20
    for a, b in zip(want[STEPS - 20 :], resumed):
        assert abs(a - b) <= 1e-5
    # FSDP checkpoint -> pipeline parallel
    _resume_copy(ref, cwd / "runs/fsdp_to_pp", STEPS - 10)
    run_cli(["train", *JOB, "run.name=fsdp_to_pp", "parallel.pp=2", "parallel.dp_shard=1"], cwd)
    resumed = losses(cwd / "runs/fsdp_to_pp")
    assert len(resumed) == 10
    for a, b in zip(want[STEPS - 10 :], resumed):
        assert abs(a - b) <= 1e-5
