"""A rank that stops making progress is named, with its last step and phase, and the run exits instead of
hanging in a collective until the (long) process-group timeout."""

import json
import os
import signal
import subprocess
import sys
import time

from test_checkpoint import _wait_for_step


def test_frozen_rank_is_named_and_the_run_ends(tmp_path):
    args = ["train", "train.steps=100000", "data.seq_len=64", "data.max_bytes=300000", "monitor.log_interval=1",
            "monitor.progress=false", "launch.hang_timeout_s=3", "launch.shutdown_timeout_s=3", "run.name=hang"]
    proc = subprocess.Popen([sys.executable, "-m", "scaletrain.cli.main", *args], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = tmp_path / "runs/hang"
    _wait_for_step(run, 5, proc)
    victim = json.loads((run / "heartbeat/rank1.json").read_text())["pid"]
    started = time.monotonic()
    os.kill(victim, signal.SIGSTOP)  # frozen: alive but making no progress, like a rank stuck in a driver call
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 1
    assert "training failed on rank" in err and "(exit 124)" in err
    assert "rank 1 looks stuck at step" in err, err[-3000:]
    assert "stopped reporting" in err
    # the diagnosis and the log pointer in one line; the stack dump stays in the rank's log
    failed = [line for line in err.splitlines() if "training failed on rank" in line]
    assert len(failed) == 1 and "rank 1 looks stuck at step" in failed[0] and "full log: runs/hang/logs/rank" in \
        failed[0], err[-3000:]
    assert "Python stacks" not in err and "Traceback" not in err, err[-3000:]
    rank = int(failed[0].split("training failed on rank ")[1].split()[0])
    assert "Python stacks of this rank" in (run / "logs" / f"rank{rank}.log").read_text()
    assert time.monotonic() - started < 60  # not the 600 s collective timeout
