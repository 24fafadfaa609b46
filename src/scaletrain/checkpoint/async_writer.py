"""Checkpoint writes kept off the training step.

1. Staging: the state is copied into host memory by a background thread (DCP's DefaultStager: pinned on a GPU, in
   shared memory when another process writes it, the buffers reused from save to save) while the next step's forward
   and backward run. The training thread waits for the copy only right before the next optimizer step, the first
   thing that changes what is being copied (an optimizer step pre-hook).
2. Write: DCP writes the staged copy in a separate process (`AsyncCheckpointerType.PROCESS`: serialisation and
   file I/O never hold this process's GIL), or a background thread (`checkpoint.async_writer="thread"`, and
   whenever no process group is up).
3. Commit: rank 0 commits in a background thread once its write finished; DCP's coordinator finishes only after
   every rank reported its files written, so no barrier is needed on the step path.

The writer process is started, and its gloo group formed, in the background when the manager opens (all ranks
together), so the first save does not wait for it either; or, with start=False, when `start()` is called (the
trainer calls it after the run's first step, so that a restart's first step does not share the host's cores with
the writer's start), at the latest by the first save. In a rank forked from a server (launch/local.py forked_ranks)
the writer is forked from that same server, which imported torch and DCP already; elsewhere it is spawned, as DCP does.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import Future
from multiprocessing import forkserver, reduction

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import _async_process_executor as process_executor
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

log = logging.getLogger("scaletrain")


class AsyncWriter:
    """Starts async DCP saves; owns the stager, the gloo group of the saves' collectives and (process mode) the
    writer process. `staging_wait_s`: seconds the training thread waited for staging copies, summed."""

    def __init__(self, mode: str, start: bool = True):
        distributed = dist.is_initialized()
        # a process writer needs the process group's ranks to form its own: without one, a thread writes
        self.mode = mode if distributed else "thread"
        # async saves run collectives off the training thread: their own gloo group (DCP also needs a CPU group)
        # keeps them from interleaving with training's collectives on the default group
        self._group = dist.new_group(backend="gloo") if distributed else None
        cuda = torch.cuda.is_available()
        self._stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=self.mode == "process",  # the writer process maps the staged copy, no pickling
                use_async_staging=True,
                use_non_blocking_copy=cuda,
            )
        )
        self._staging: Future | None = None
        self._hooked: set[int] = set()
        self.staging_wait_s = 0.0
        self._owns_process = False
        self._closed = False
        self._starting: threading.Thread | None = None
        self._started = False
        if start:
            self.start()

    def start(self) -> None:
        """Spawn the writer process in the background (it imports torch and forms a gloo group: seconds); a
        collective on the first call (every rank calls it at the same point), nothing after it or in thread mode."""
        if self._started or self._closed:
            return
        self._started = True
        if self.mode == "process":
            self._start_process()

    def _start_process(self) -> None:
        if process_executor._CHECKPOINT_PROCESS is not None:
            return  # another manager of this process started one (the benchmark's pair)
        info = process_executor._ProcessGroupInitInfo(self._group)  # a broadcast: every rank takes part, now

        def spawn() -> None:
            # default priority: a niced writer (tried: +10) fell 4+ steps behind on a loaded host, late to be durable
            process_executor._CHECKPOINT_PROCESS = _WriterProcess(info)

        self._owns_process = True
        self._starting = threading.Thread(target=spawn, name="scaletrain-ckpt-writer-start", daemon=True)
        self._starting.start()

    def ready(self) -> float:
        """Block until the writer process is up (it starts in the background); returns the seconds waited."""
        t0 = time.perf_counter()
        if self._starting is not None:
            self._starting.join()
            self._starting = None
        return time.perf_counter() - t0

    def write(self, state: dict, checkpoint_id: str, optimizer: torch.optim.Optimizer) -> Future:
        """Stage `state` in the background and write it to `checkpoint_id`; returns the write's future. The
        optimizer's next step waits for the staging copy."""
        self.start()  # a writer started later than its manager opened: at the first save at the latest
        self.ready()  # the first save only, and only if the writer process is still starting
        kind = AsyncCheckpointerType.PROCESS if self.mode == "process" else AsyncCheckpointerType.THREAD
        response = dcp.async_save(
            state,
            checkpoint_id=checkpoint_id,
            process_group=self._group,
            async_checkpointer_type=kind,
            async_stager=self._stager,
        )
        # an async stager answers with both futures (staging, write)
        assert isinstance(response, AsyncSaveResponse), type(response)
        if id(optimizer) not in self._hooked:
            # one hook for the optimizer's life, a no-op when no copy is pending (a hook cannot remove itself
            # while the optimizer iterates its hooks)
            optimizer.register_step_pre_hook(lambda *_: self.wait_staging())
            self._hooked.add(id(optimizer))
        self._staging = response.staging_completion
        return response.upload_completion

    def wait_staging(self) -> None:
        """Block until the pending staging copy is complete (the weights may change after this)."""
        if self._staging is None:
            return
        t0 = time.perf_counter()
        staging, self._staging = self._staging, None
        staging.result()
        self.staging_wait_s += time.perf_counter() - t0

    def close(self) -> None:
        """Release the staging buffers and stop the writer process this writer started."""
        if self._closed:
            return
        self._closed = True
        self.wait_staging()
        if self._starting is not None:
            self._starting.join()
            self._starting = None
        self._stager.close()
        if self._owns_process and process_executor._CHECKPOINT_PROCESS is not None:
            proc, process_executor._CHECKPOINT_PROCESS = process_executor._CHECKPOINT_PROCESS, None
            proc.__del__()  # torch's own shutdown: a terminate request, a 5 s join, then SIGTERM
            self._owns_process = False


WRITER_NAME = "ckpt-writer"  # the writer process's name (ps, psutil's name()): tells it apart from its rank siblings


class _WriterProcess(process_executor._AsyncCheckpointProcess):
    """DCP's writer process (the same handshake, serving loop and shutdown), started from the forkserver that forked
    this process where there is one: it imported torch and DCP before it forked the ranks (launch/local.py
    RANK_IMPORTS), so the writer is up in a fraction of a second instead of a spawned interpreter's ~3 s of CPU per
    rank, paid again by every restart. Elsewhere it is spawned, as DCP does (a forked CUDA context is unusable). A
    forked writer takes what a spawned one inherits from its rank: the environment, stdout/stderr (the rank's log)
    and the process group (what a dead rank leaves in its group is killed with it: launch/inprocess.py)."""

    def __init__(self, pg_init_info: process_executor._ProcessGroupInitInfo) -> None:
        method = "forkserver" if _forked_by_a_forkserver() else "spawn"
        self.ctx = multiprocessing.get_context(method)  # type: ignore[assignment]
        self._process_pipe, child_end = self.ctx.Pipe()
        self._save_process = self.ctx.Process(
            target=_writer_main,
            args=(dict(os.environ), _Fd(1), _Fd(2), os.getpgrp(), pg_init_info, child_end),
            daemon=True,
        )
        self._save_process.start()
        child_end.close()  # the parent's copy: a dead writer then fails the pipe's reads at once
        response = self._wait_for_response(timeout=1800)  # DCP's own bound (gloo's default init timeout)
        if response != process_executor._CheckpointSaveProcessControlOpts.INIT_COMPLETE:
            raise AssertionError(f"Expected INIT_COMPLETE response, got {response}")


def _forked_by_a_forkserver() -> bool:
    """True in a process that a forkserver forked: it knows its server's address but started none itself."""
    server = forkserver._forkserver
    return getattr(server, "_forkserver_address", None) is not None and getattr(server, "_forkserver_pid", 0) is None


class _Fd:
    """A file descriptor of this process, handed to the child it is pickled for (multiprocessing's DupFd: the fd is
    sent to the forkserver, or kept open through a spawn); the child receives the fd number."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return (_detach, (reduction.DupFd(self.fd),))


def _detach(dup) -> int:
    return dup.detach()


def _writer_main(environ: dict, stdout: int, stderr: int, group: int, pg_init_info, conn) -> None:
    try:
        os.setpgid(0, group)
    except OSError:  # the rank's group is gone: the rank died while this process started
        os._exit(1)
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    for fd in {stdout, stderr} - {1, 2}:
        os.close(fd)
    os.environ.clear()
    os.environ.update(environ)
    try:
        with open("/proc/self/comm", "w") as comm:  # Linux: the name ps and psutil show
            comm.write(WRITER_NAME)
    except OSError:
        pass
    process_executor._AsyncCheckpointProcess._checkpointing_subprocess(pg_init_info, conn)
