"""In-memory snapshots (checkpoint.memory_interval_steps): a rank SIGKILLed right after a snapshot, long after the
last disk checkpoint, resumes from host memory and loses no step — the final weights and every step's loss equal an
unkilled run's, bit for bit — and a finished run frees the snapshot. The snapshot's own format (each rank's shards
in one file, read back only into the layout that wrote it) is checked in one process first."""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import losses, run_cli
from test_checkpoint import _workers
from scaletrain.checkpoint.export import load_full_model_state
from scaletrain.checkpoint import CheckpointManager
from scaletrain.checkpoint.memory import SNAPSHOT_DIR_ENV, snapshot_root
from scaletrain.config.schema import CheckpointConfig
from scaletrain.config import ConfigError, load_config
from scaletrain.monitor.faults import ENV as FAULTS

STEPS = 24
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
    "monitor.tensorboard=false",
    "monitor.sample_interval_s=0",
    "checkpoint.interval_steps=20",  # no disk checkpoint before the kill (steps 12-17)
    "checkpoint.memory_interval_steps=3",
    "checkpoint.save_final=true",
]
SLOW_STEPS = {FAULTS: "data_delay_ms=80"}  # time to kill between two snapshots; the arithmetic is unchanged


def start_slow_train(cwd: Path, args: list[str], stdout=subprocess.PIPE, env: dict | None = None) -> subprocess.Popen:
    """`scaletrain train ARGS` in the background, its steps slowed (SLOW_STEPS, or `env`), stderr piped (as text)."""
    return subprocess.Popen(
        [sys.executable, "-m", "scaletrain.cli.main", "train", *args],
        cwd=cwd,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or SLOW_STEPS)},
    )


def wait_while_running(proc: subprocess.Popen, done: Callable[[], bool], deadline: float) -> None:
    """Poll `done` every 10 ms; fail with the run's last output if it ends, or `deadline` (monotonic) passes, first."""
    while not done():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:] if proc.stderr else ""
        time.sleep(0.01)


def _snapshot_step(run: Path) -> int:
    try:
        return json.loads((run / "checkpoints" / "memory.json").read_text())["step"]
    except (OSError, ValueError):
        return 0


def assert_same_final_weights(run: Path, ref: Path, steps: int) -> None:
    """The final checkpoints of two runs hold the same tensors, bit for bit."""
    got = load_full_model_state(run / "checkpoints" / f"step_{steps:08d}")[0]
    want = load_full_model_state(ref / "checkpoints" / f"step_{steps:08d}")[0]
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def _trained(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _snapshots(root: Path, layout: str = "none") -> CheckpointManager:
    cfg = CheckpointConfig(async_save=False, keep=0, memory_interval_steps=1)
    return CheckpointManager(cfg, root, 0, 1, {"layout": layout, "world_size": 1})


def test_snapshot_is_one_file_per_rank_and_restores_model_and_optimizer_exactly(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(SNAPSHOT_DIR_ENV, str(tmp_path / "shm"))
    root = tmp_path / "checkpoints"
    model, opt = _trained(0)
    _snapshots(root).save(2, *_trained(1), {"loader": {}})  # an older disk checkpoint of other weights
    _snapshots(root).snapshot(5, model, opt, {"loader": {"position": 7}})
    snap = snapshot_root(root) / "step_00000005"
    assert sorted(p.name for p in snap.iterdir()) == ["rank0.pt", "rng_rank0.json", "snapshot.json", "trainer.json"]

    fresh, fresh_opt = _trained(2)
    restored = _snapshots(root).restore(fresh, fresh_opt)
    assert restored is not None and restored.step == 5 and restored.path == snap
    assert restored.trainer_state["loader"] == {"position": 7}
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    want, got = opt.state_dict(), fresh_opt.state_dict()
    assert want["param_groups"] == got["param_groups"]
    for i, state in want["state"].items():
        for k, v in state.items():
            assert torch.equal(v, got["state"][i][k]), (i, k)

    # taken by another layout: the disk checkpoint (older) is what this one loads, and the log says why
    with caplog.at_level("WARNING", logger="scaletrain"):
        other = _snapshots(root, layout="fsdp (dp_shard=1)").restore(*_trained(3))
    assert other is not None and other.step == 2
    assert "taken by none on 1 rank(s), this run is fsdp (dp_shard=1) on 1" in caplog.text

    (snap / "rank0.pt").unlink()  # a rank's file missing: not a snapshot to resume from
    assert _snapshots(root).restore(*_trained(3)).step == 2


def test_memory_snapshots_refuse_several_nodes_in_one_line():
    with pytest.raises(ConfigError, match="checkpoint.memory_interval_steps") as e:
        load_config(None, ["checkpoint.memory_interval_steps=5", "launch.nnodes=2"])
    assert "\n" not in str(e.value)


@pytest.mark.slow  # an unkilled launch, and a launch killed and restarted
def test_kill_right_after_a_memory_snapshot_resumes_from_memory_losing_no_step(tmp_path):
    run_cli(["train", *JOB, "run.name=clean"], tmp_path, env=SLOW_STEPS)
    ref = tmp_path / "runs" / "clean"
    assert not snapshot_root(ref / "checkpoints").exists()  # a finished run frees its snapshot
    assert not (ref / "checkpoints" / "memory.json").exists()

    run = tmp_path / "runs" / "killed"
    proc = start_slow_train(tmp_path, [*JOB, "run.name=killed", "launch.max_restarts=1"])
    # past the first snapshots, far from the disk checkpoint of step 20
    wait_while_running(proc, lambda: _snapshot_step(run) >= 12, time.monotonic() + 300)
    victims = _workers(run)
    assert len(victims) == 2, victims
    os.kill(victims[-1], signal.SIGKILL)
    newest = _snapshot_step(run)  # no snapshot commits without the killed rank
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert 12 <= newest < 20 and f"checkpoint: step {newest} is in host memory" in err, err[-3000:]
    assert f"at step {newest} (saved by" in err, err[-3000:]  # resumed from the snapshot: no step lost
    assert_same_final_weights(run, ref, STEPS)
    assert losses(run) == losses(ref)
    assert not snapshot_root(run / "checkpoints").exists()
