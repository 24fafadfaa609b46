"""One log file per rank for runs `scaletrain train` launches itself: RUN_DIR/logs/rank<r>.log keeps everything a
worker writes (tracebacks, the watchdog's stack dumps, library warnings), so the terminal shows rank 0's progress
and one line per failure that points at the file.

Worker side: `redirect_to_rank_log` moves the process's stdout and stderr into the file (file descriptors 1 and 2,
so C++ and faulthandler output too) and hands back a stream to the terminal. Agent side: `quiet_agent_failures`
turns torch elastic's multi-line failure logging into those single lines, and `failure_line` words the last one.
Both sides read and write one format, so it lives here, where the trainer and the command may both import it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

ATTEMPT_MARK = "--- scaletrain rank"  # starts each attempt's section in a rank log (restarts append)


def rank_log(run_dir: Path, rank: int) -> Path:
    return run_dir / "logs" / f"rank{rank}.log"


def redirect_to_rank_log(run_dir: Path, rank: int) -> TextIO:
    """Append this process's stdout and stderr to its rank log; returns a line-buffered stream to where stderr
    pointed before (the terminal), for what the user should still see."""
    path = rank_log(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    console = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    os.write(
        fd,
        f"{ATTEMPT_MARK} {rank}, attempt {attempt}, pid {os.getpid()}, "
        f"{time.strftime('%Y-%m-%d %H:%M:%S')} ---\n".encode(),
    )
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return console


def log_exception(rank: int, exc: BaseException) -> None:
    """The traceback, then one `[rank<r>] Type: message` line that `failure_cause` finds, to stderr."""
    traceback.print_exception(exc, file=sys.stderr)
    first = (str(exc).strip().splitlines() or [""])[0]
    sys.stderr.write(f"[rank{rank}] {type(exc).__name__}{': ' + first if first else ''}\n")
    sys.stderr.flush()


def failure_cause(path: Path, rank: int) -> str | None:
    """The last `[rank<r>] ...` line of the latest attempt in a rank log (an exception's summary, or the
    watchdog's hang diagnosis; both are written last), without the prefix; None if there is none."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    starts = [i for i, line in enumerate(lines) if line.startswith(ATTEMPT_MARK)]
    prefix = f"[rank{rank}] "
    found = [line[len(prefix) :].strip() for line in lines[starts[-1] if starts else 0 :] if line.startswith(prefix)]
    return found[-1] if found else None


def _exit_text(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"exit {exitcode}, killed by {signal.Signals(-exitcode).name}"
    return f"exit {exitcode}"


def _shown(path: Path) -> str:
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(Path.cwd()))
    return str(path)


def failure_line(run_dir: Path, rank: int, exitcode: int | None) -> str:
    """`rank R (exit N): cause; full log: PATH`: what a failed rank's log says, in one line."""
    path = rank_log(run_dir, rank)
    cause = failure_cause(path, rank)
    return f"rank {rank} ({_exit_text(exitcode)})" + (f": {cause}" if cause else "") + f"; full log: {_shown(path)}"


def _killed_rank(local_rank: int, exitcode: int) -> tuple[int, int]:
    """The failed rank to name: torch reports the first exited rank in rank order, so a rank SIGKILLed (the OOM
    killer, an operator) whose peer then fails on the broken collective (exit 1, "Connection reset by peer") is
    reported as that peer's failure whenever both ended before the agent's next poll. A SIGKILL always comes from
    outside, never as the consequence of a peer's failure (an abort's SIGABRT can): name that rank. Read from the
    worker processes of the agent's context, found on the logging call's stack (torch's MultiprocessContext._poll);
    the reported rank where they are not there."""
    if exitcode == -signal.SIGKILL:
        return local_rank, exitcode
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "_poll" and hasattr(frame.f_locals.get("self"), "_pc")):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return local_rank, exitcode
    processes = getattr(frame.f_locals["self"]._pc, "processes", [])
    for rank, proc in enumerate(processes):
        if proc.exitcode == -signal.SIGKILL:
            return rank, proc.exitcode
    return local_rank, exitcode


class _AgentFailures(logging.Filter):
    """Drops torch elastic's failure traceback and shutdown chatter in the agent process; prints one line for a
    failure the agent restarts from (the CLI words the final one from ChildFailedError)."""

    def __init__(self, run_dir: Path, restarts: int, nnodes: int):
        super().__init__()
        self.run_dir, self.restarts_left, self.restarts, self.nnodes = run_dir, restarts, restarts, nnodes
        # (local rank, exit code) of the last failure when it was a SIGKILLed rank: the one to name at the end too
        self.killed: tuple[int, int] | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if msg.startswith(("Terminating process", "Closing process")):
            return False
        # torch 2.13 (elastic/multiprocessing/api.py, MultiprocessContext._poll): logger.exception("failed
        # (exitcode: %s) local_rank: %s (pid: %s) of fn: %s (start_method: %s)", ...) once per failed worker group
        if not (msg.startswith("failed (exitcode") and isinstance(record.args, tuple) and len(record.args) == 5):
            return True
        exitcode, local_rank = int(record.args[0]), int(record.args[1])  # type: ignore[call-overload]
        local_rank, exitcode = _killed_rank(local_rank, exitcode)
        self.killed = (local_rank, exitcode) if exitcode == -signal.SIGKILL else None
        if self.restarts_left > 0:
            self.restarts_left -= 1
            done = self.restarts - self.restarts_left
            who = (
                failure_line(self.run_dir, local_rank, exitcode)
                if self.nnodes == 1
                else f"local rank {local_rank} ({_exit_text(exitcode)}); logs in {_shown(self.run_dir / 'logs')}"
            )
            sys.stderr.write(
                f"scaletrain: restarting the worker group (restart {done} of {self.restarts}) after "
                f"a failure on {who}\n"
            )
            sys.stderr.flush()
        return False


@contextlib.contextmanager
def quiet_agent_failures(run_dir: Path, restarts: int, nnodes: int) -> Iterator[_AgentFailures]:
    """While the torchrun agent runs in this process: one line per worker failure instead of torch elastic's
    tracebacks (the full ones are in the rank logs). Yields the filter: `killed` is the last failure when a rank was SIGKILLed."""
    names = ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")
    filt = _AgentFailures(run_dir, restarts, nnodes)
    for name in names:
        logging.getLogger(name).addFilter(filt)
    try:
        yield filt
    finally:
        for name in names:
            logging.getLogger(name).removeFilter(filt)
