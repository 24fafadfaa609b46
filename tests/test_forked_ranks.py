"""Ranks forked from one server (launch/local.py forked_ranks): a signal sent to the whole launch (Slurm's srun
signals every process of its step) reaches the ranks and leaves the server forking, and a process a rank left
behind does not outlive the launch; a rank's checkpoint writer is forked from the same server, writing into the rank's
log. The real launches are in the Slurm tests (preemption) and test_checkpoint_memory
(a rank SIGKILLed while its checkpoint writer starts)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import psutil

from scaletrain.checkpoint.async_writer import WRITER_NAME
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


def _save_through_a_writer_process(folder: str, log: str, queue) -> None:
    import gc

    frozen = gc.get_freeze_count()  # what the server imported, out of this rank's collections
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint import _async_process_executor as process_executor

    from scaletrain.checkpoint.async_writer import AsyncWriter

    with open(log, "w") as f:
        os.dup2(f.fileno(), 2)  # the rank's log, as the agent redirects a rank's output
    os.setpgid(0, 0)  # a group of its own, as the in-process launcher's ranks have
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), 1), rank=0, world_size=1)
    writer = AsyncWriter("process")
    model = torch.nn.Linear(4, 4)
    saved = writer.write({"w": model.weight}, os.path.join(folder, "ckpt"), torch.optim.SGD(model.parameters()))
    saved.result(timeout=60)
    proc = psutil.Process(process_executor._CHECKPOINT_PROCESS._save_process.pid)
    queue.put(
        {
            "parent": proc.ppid(),
            "name": proc.name(),
            "server": os.getppid(),
            "frozen": frozen,
            "groups": (os.getpgid(proc.pid), os.getpgrp()),
            "mine": [p.pid for p in psutil.Process().children()],
        }
    )
    writer.close()
    dist.destroy_process_group()


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


def test_a_ranks_checkpoint_writer_is_forked_from_the_server_and_writes_into_the_ranks_log(tmp_path):
    """DCP spawns its writer (an interpreter importing torch: ~3 s of CPU per rank, on every start and restart); a
    forked rank's writer comes from the rank's own server, named, with the rank's stderr and process group; the
    objects the rank inherits from the server are out of its garbage collections."""
    log = tmp_path / "rank0.log"
    with forked_ranks("torch.distributed.checkpoint") as method:
        ctx = multiprocessing.get_context(method)
        queue = ctx.SimpleQueue()
        rank = ctx.Process(target=_save_through_a_writer_process, args=(str(tmp_path), str(log), queue))
        rank.start()
        rank.join(120)
        assert rank.exitcode == 0, log.read_text()
        seen = queue.get()
    assert seen["parent"] == seen["server"]  # not the rank's child: forked by the server that forked the rank
    assert seen["name"] == WRITER_NAME and seen["mine"] == []
    assert seen["frozen"] > 100_000  # torch's and DCP's objects (~250,000), which a collection no longer walks
    assert seen["groups"][0] == seen["groups"][1]  # in the rank's process group, as a child of the rank would be
    assert "Checkpoint background process is running" in log.read_text()  # DCP's writer logged into the rank's log
    assert (tmp_path / "ckpt" / ".metadata").is_file()
