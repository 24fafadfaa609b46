"""Ranks forked from one server (launch/local.py forked_ranks): a signal sent to the whole launch (Slurm's srun
signals every process of its step) reaches the ranks and leaves the server forking, and a process a rank left
behind does not outlive the launch. The real launches are in the Slurm tests (preemption) and test_checkpoint_memory
(a rank SIGKILLed while its checkpoint writer starts)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import psutil

from scaletrain.launch.local import forked_ranks


HANDLED = 7


def _wait_for_signal(ready) -> None:
    signal.signal(signal.SIGUSR1, lambda *_: os._exit(HANDLED))
    ready.set()
    time.sleep(30)


def _leave_a_sleeper(pid_file: str) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(pid_file, "w") as f:
        f.write(str(sleeper.pid))
    os._exit(0)  # SIGKILL-like: no cleanup, the sleeper is orphaned


def test_a_signal_to_the_launch_reaches_the_ranks_and_the_server_forks_on():
    with forked_ranks() as method:
        assert method == "forkserver"
        ctx = multiprocessing.get_context(method)
        ready = ctx.Event()
        rank = ctx.Process(target=_wait_for_signal, args=(ready,))
        rank.start()
        assert ready.wait(30)
        server = psutil.Process(rank.pid).ppid()
        assert server != os.getpid()
        os.kill(server, signal.SIGUSR1)  # what srun does to every process of the step
        os.kill(rank.pid, signal.SIGUSR1)
        rank.join(30)
        assert rank.exitcode == HANDLED  # the rank handled it; the server reported its exit
        assert psutil.Process(server).is_running()
        ready = ctx.Event()
        again = ctx.Process(target=_wait_for_signal, args=(ready,))
        again.start()  # the same server forks the next rank
        assert ready.wait(30)
        os.kill(again.pid, signal.SIGTERM)  # not blocked in a rank: its default action ends it
        again.join(30)
        assert again.exitcode == -signal.SIGTERM


def test_what_a_rank_leaves_behind_ends_with_the_launch(tmp_path):
    pid_file = tmp_path / "sleeper"
    with forked_ranks() as method:
        rank = multiprocessing.get_context(method).Process(target=_leave_a_sleeper, args=(str(pid_file),))
        rank.start()
        rank.join(30)
        sleeper = int(pid_file.read_text())
        assert psutil.Process(sleeper).ppid() == os.getpid()  # adopted by the launching process, not init
    deadline = time.monotonic() + 10
    while psutil.pid_exists(sleeper) and psutil.Process(sleeper).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the orphan outlived the launch"
        time.sleep(0.05)
