"""In-process restart (launch.restart=in-process): a rank SIGKILLed mid-run is replaced by a warm spare while the
surviving rank keeps its process (same PID, no re-import), and the run ends with every step's loss and the final
weights bit-identical to an unkilled run's; a layout it cannot serve is refused in one line before launch."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import losses, run_cli
from test_checkpoint_memory import _snapshot_step, assert_same_final_weights
from scaletrain.config import ConfigError, load_config
from scaletrain.monitor.faults import ENV as FAULTS

STEPS = 10
VICTIM = 0  # rank 0 writes the metrics and commits the checkpoints: the harder rank to lose
JOB = [
    f"train.steps={STEPS}",
    "monitor.log_interval=1",
    "train.global_batch_size=8",
    "data.seq_len=32",
    "train.eval_batches=1",
    "train.eval_interval=0",
    "data.max_bytes=100000",
    "train.warmup_steps=2",
    "monitor.progress=false",
    "monitor.tensorboard=false",
    "monitor.sample_interval_s=0",
    "checkpoint.interval_steps=0",  # no disk checkpoint before the end: the restart resumes from host memory
    "checkpoint.memory_interval_steps=2",
    "checkpoint.save_final=true",
    "launch.restart=in-process",
]
SLOW_STEPS = {FAULTS: "data_delay_ms=80"}  # time to kill between two snapshots; the arithmetic is unchanged


def _pids(run: Path, rank: int) -> list[int]:
    """The PID of each generation this rank ran in, from its rank log's section headers."""
    text = (run / "logs" / f"rank{rank}.log").read_text()
    return [int(p) for p in re.findall(rf"--- scaletrain rank {rank}, attempt \d+, pid (\d+)", text)]


def test_in_process_restart_refuses_several_nodes_in_one_line():
    with pytest.raises(ConfigError, match="launch.restart") as e:
        load_config(None, ["launch.restart=in-process", "launch.nnodes=2", "launch.rdzv_endpoint=10.0.0.1:29500"])
    assert "\n" not in str(e.value)


@pytest.mark.slow  # an unkilled launch, and a launch whose rank 0 is killed and replaced in-process
def test_sigkilled_rank_is_replaced_in_process_survivor_keeps_its_pid_and_losses_match(tmp_path):
    run_cli(["train", *JOB, "run.name=clean", "launch.spares=0"], tmp_path)  # no spare importing beside it
    ref = tmp_path / "runs" / "clean"

    run = tmp_path / "runs" / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "scaletrain.cli.main", "train", *JOB, "run.name=killed", "launch.max_restarts=1"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **SLOW_STEPS},
    )
    deadline = time.monotonic() + 300
    while _snapshot_step(run) < 4:  # a few steps in, with a snapshot to resume from
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:] if proc.stderr else ""
        time.sleep(0.01)
    victim, survivor = _pids(run, VICTIM)[0], _pids(run, 1 - VICTIM)[0]
    os.kill(victim, signal.SIGKILL)
    newest = _snapshot_step(run)  # no snapshot commits without the killed rank
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]

    # the survivor ran both generations in one process; a warm spare (another PID) took the dead rank
    assert _pids(run, 1 - VICTIM) == [survivor, survivor], err[-3000:]
    victim_pids = _pids(run, VICTIM)
    assert len(victim_pids) == 2 and victim_pids[0] == victim and victim_pids[1] != victim
    assert f"spare pid {victim_pids[1]} takes rank {VICTIM}" in err, err[-3000:]
    assert f"at step {newest} (saved by" in err, err[-3000:]  # resumed from the snapshot: no step lost

    assert_same_final_weights(run, ref, STEPS)
    assert losses(run) == losses(ref)
