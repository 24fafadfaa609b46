"""A rank that stops making progress is named with each rank's last completed step, and the run ends soon after
the hang limit instead of waiting in a collective (or in the agent's SIGTERM grace). The same launch checks that a
local run listens on 127.0.0.1 only."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
from test_checkpoint import _wait_for_step

from scaletrain.monitor import read_jsonl
from scaletrain.train.watchdog import Watchdog

HANG_S = 5


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket of a process and its descendants."""
    found = set()
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            found |= {
                (c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN
            }
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.mark.slow  # a launch that waits out the hang limit; which process is killed and the diagnosis stay fast below
def test_frozen_rank_is_named_and_the_run_ends(tmp_path):
    # launch.shutdown_timeout_s keeps its 30 s default: the run must end without sitting it out
    args = [
        "train",
        "train.steps=100000",
        "data.seq_len=64",
        "data.max_bytes=300000",
        "monitor.log_interval=1",
        "monitor.progress=false",
        f"launch.hang_timeout_s={HANG_S}",
        "run.name=hang",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "scaletrain.cli.main", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    run = tmp_path / "runs/hang"
    _wait_for_step(run, 5, proc)
    # agent's rendezvous store, rank 0's store, gloo's pair sockets: all on loopback, none on 0.0.0.0 / :: / eth
    listening = _listening(proc.pid)
    assert len(listening) >= 3 and {ip for ip, _ in listening} == {"127.0.0.1"}, listening

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
    ended_after = time.monotonic() - started
    assert proc.returncode == 1
    # the diagnosis and a pointer to the rank's log, in one line; the stack dump stays in that log
    failed = [line for line in err.splitlines() if "training failed on rank" in line]
    assert len(failed) == 1 and failed[0].startswith("scaletrain: training failed on rank 0 (exit 124): hang:"), err[
        -3000:
    ]
    assert "full log: runs/hang/logs/rank0" in failed[0], failed[0]
    assert "Python stacks" not in err and "Traceback" not in err, err[-3000:]
    rank0_log = (run / "logs" / "rank0.log").read_text()
    assert "Python stacks of this rank" in rank0_log and "killing rank(s) 1 after this one exits" in rank0_log
    done = max(r["step"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r)
    # FSDP: neither rank can finish a step the other has not; both completed exactly the steps logged
    assert "rank 1 looks stuck in phase '" in failed[0], failed[0]
    assert f"(last completed step {done}; its process stopped reporting" in failed[0], (done, failed[0])
    assert f"rank 0: last completed step {done}, waiting in phase '" in failed[0], (done, failed[0])
    assert ended_after < HANG_S + 10, ended_after  # a hang-detection bound, not a speed test


def _beat(rank, step, phase, done, age_s, now, **extra):
    return {
        "rank": rank,
        "pid": 1,
        "host": socket.gethostname(),
        "started": 0.0,
        "round": 0,
        "step": step,
        "phase": phase,
        "last_completed_step": done,
        "progress_time": now - 30,
        "time": now - age_s,
        **extra,
    }


def test_diagnose_names_the_frozen_rank_and_every_last_completed_step(tmp_path):
    now = 1_000_000.0
    beats = {
        "rank0.json": _beat(0, 21, "forward/backward", 20, 0.3, now),
        "rank1.json": _beat(1, 21, "optimizer", 20, 25.0, now),
        "rank2.json": _beat(2, 21, "forward/backward", 20, 0.5, now),
        "rank3.json": _beat(3, 99, "data", 98, 0.1, now, round=1),  # a later round's file: ignored
        "rank4.json": _beat(4, 99, "data", 98, 90.0, now, host="other"),
    }  # another host: not visible
    for name, beat in beats.items():
        (tmp_path / name).write_text(json.dumps(beat) + " " * 50)
    (tmp_path / "rank5.json").write_text('{"rank": 5, "st')  # torn: skipped
    message, silent = Watchdog(tmp_path, 0, 4, timeout_s=20, first_step_timeout_s=600).diagnose(20, now=now)
    assert message.startswith(
        "hang: no progress for 20 s; rank 1 looks stuck in phase 'optimizer' of step 21 "
        "(last completed step 20; its process stopped reporting 25 s ago); "
    ), message
    assert "rank 0: last completed step 20, waiting in phase 'forward/backward' of step 21" in message
    assert "rank 2: last completed step 20, waiting" in message
    assert "rank 3" not in message and "rank 4" not in message
    assert message.endswith("(3 of 4 ranks are on this host)")
    assert [b["rank"] for b in silent] == [1]

    # every rank still reports: the one furthest behind is named, nobody is to be killed
    (tmp_path / "rank1.json").write_text(json.dumps(_beat(1, 20, "optimizer", 19, 0.2, now)))
    message, silent = Watchdog(tmp_path, 0, 3, timeout_s=20, first_step_timeout_s=600).diagnose(20, now=now)
    assert (
        "rank 1 looks stuck in phase 'optimizer' of step 20 (last completed step 19; it is furthest behind)" in message
    ), message
    assert silent == []


def test_only_the_very_process_of_a_silent_heartbeat_is_killed(tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        dog = Watchdog(tmp_path, 0, 2, timeout_s=20, first_step_timeout_s=600)
        beat = {
            "rank": 1,
            "pid": sleeper.pid,
            "host": socket.gethostname(),
            "started": psutil.Process(sleeper.pid).create_time(),
        }
        assert dog._same_process(beat)
        assert not dog._same_process({**beat, "started": beat["started"] - 100})  # pid reused by another process
        assert not dog._same_process({**beat, "host": "elsewhere"})
        assert not dog._same_process({**beat, "pid": os.getpid()})
    finally:
        sleeper.kill()
