"""Hang detection: every rank publishes a heartbeat (current step and phase, last completed step, liveness) and a
background thread notices when its own rank made no progress for too long. It then names the stuck rank from all
heartbeats (the one whose process stopped reporting, or which is furthest behind), dumps this rank's Python stacks,
exits EXIT_HANG instead of waiting in a collective, and has local ranks that stopped reporting SIGKILLed right
after (frozen or wedged, they would ignore SIGTERM and hold the agent for its 30 s grace). The torchrun agent then
restarts the group (launch.max_restarts) or fails the job.

Heartbeats are small JSON records in RUN_DIR/heartbeat/rankN.json, memory-mapped: `beat()` rewrites the record in
place (a memory copy, no system call), so a rank frozen mid-step (SIGSTOP, a wedged driver call) still shows the
step and phase it froze in, not the last one its thread got to write. Only ranks of this host are read; on several
hosts the message says how many it saw.
"""

from __future__ import annotations

import faulthandler
import json
import mmap
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from scaletrain.exit_codes import EXIT_HANG

# run by a helper process: wait until process argv[1] is reaped (/proc/PID lasts while it is a zombie), then SIGKILL
_KILLER = """import os, sys, time
while os.path.exists(f"/proc/{sys.argv[1]}"):
    time.sleep(0.05)
for pid in sys.argv[2:]:
    try:
        os.kill(int(pid), 9)  # SIGKILL
    except OSError:
        pass
"""
RECORD_BYTES = 1024  # one heartbeat: JSON padded with spaces


def check_period(timeout_s: float) -> float:
    """Seconds between liveness updates and hang checks: a tenth of the limit, 0.1-1 s."""
    return min(1.0, max(0.1, timeout_s / 10))


def silent_after(timeout_s: float) -> float:
    """A heartbeat not rewritten for this long (seconds) means its process is frozen, wedged or gone."""
    return max(2.0, 5 * check_period(timeout_s))


def read_heartbeats(folder: Path) -> list[dict]:
    """Every readable heartbeat record in `folder`; a record caught mid-rewrite is read again."""
    beats = []
    for path in sorted(folder.glob("rank*.json")):
        for _ in range(5):
            try:
                first = path.read_bytes()
                if first == path.read_bytes():  # not torn by a concurrent rewrite
                    beats.append(json.loads(first))
                    break
            except (OSError, ValueError):
                pass
    return beats


class Watchdog:
    def __init__(self, folder: Path, rank: int, world_size: int, timeout_s: float, first_step_timeout_s: float):
        self.folder = folder
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.first_step_timeout_s = first_step_timeout_s
        self.enabled = timeout_s > 0
        self._record = {
            "rank": rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": psutil.Process().create_time(),
            "round": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "step": 0,
            "phase": "start",
            "last_completed_step": 0,
            "progress_time": time.time(),
            "time": time.time(),
            "watching": True,  # False once the training loop is left: a record no longer rewritten is not a freeze
        }
        self._last = time.monotonic()
        self._first_step: int | None = None
        self._first_step_done = False
        self._lock = threading.Lock()  # the training thread and the watchdog thread both rewrite the record
        self._map: mmap.mmap | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Watchdog:
        if self.enabled:
            self.folder.mkdir(parents=True, exist_ok=True)
            # a fresh file each time: a frozen process of an earlier round keeps writing to its own (unlinked) one
            tmp = self.folder / f".rank{self.rank}.json.tmp"
            tmp.write_bytes(b" " * RECORD_BYTES)
            with open(tmp, "r+b") as f:
                self._map = mmap.mmap(f.fileno(), RECORD_BYTES)
            os.replace(tmp, self.folder / f"rank{self.rank}.json")
            self._publish()
            self._thread = threading.Thread(target=self._run, name="scaletrain-watchdog", daemon=True)
            self._thread.start()
        return self

    def beat(self, step: int, phase: str) -> None:
        """Record progress: this rank is now in `phase` of `step`. Cheap: a memory write, no I/O."""
        if self._first_step is None:
            self._first_step = step
        elif step > self._first_step:
            self._first_step_done = True  # start-up, first compile and first collectives are behind us
        self._last = time.monotonic()
        self._publish(step=step, phase=phase, progress_time=time.time())

    def completed(self, step: int) -> None:
        """Record that `step` is done: its update applied and its metrics agreed by every rank."""
        self._publish(last_completed_step=step)

    def _publish(self, **changes) -> None:
        with self._lock:
            self._record.update(changes, time=time.time())
            if self._map is not None:
                self._map[:] = json.dumps(self._record).encode()[:RECORD_BYTES].ljust(RECORD_BYTES)

    def _run(self) -> None:
        while not self._stop.wait(check_period(self.timeout_s)):
            self._publish()
            limit = self.timeout_s if self._first_step_done else self.first_step_timeout_s
            if time.monotonic() - self._last > limit:
                self._fire(limit)

    def diagnose(self, limit: float, beats: list[dict] | None = None, now: float | None = None) -> tuple[str, list]:
        """One line naming the stuck rank from the heartbeats of this host's ranks in this round, and the
        heartbeats of processes that stopped reporting (frozen, wedged or gone)."""
        now = time.time() if now is None else now
        beats = read_heartbeats(self.folder) if beats is None else beats
        mine = self._record
        beats = [
            b
            for b in beats
            if b.get("host") == mine["host"] and b.get("round") == mine["round"] and b.get("rank", -1) < self.world_size
        ]
        if not any(b["rank"] == self.rank for b in beats):
            beats.append(dict(mine))
        silent = [b for b in beats if now - b["time"] > silent_after(self.timeout_s)]
        if silent:
            worst = max(silent, key=lambda b: now - b["time"])
            why = f"its process stopped reporting {now - worst['time']:.0f} s ago"
        else:
            worst = min(beats, key=lambda b: (b["last_completed_step"], b["step"], b["progress_time"]))
            why = "it is furthest behind"
        others = "; ".join(
            f"rank {b['rank']}: last completed step {b['last_completed_step']}, "
            f"{'stopped reporting' if b in silent else 'waiting'} in phase '{b['phase']}' of step "
            f"{b['step']}"
            for b in sorted(beats, key=lambda b: b["rank"])
            if b is not worst
        )
        seen = f" ({len(beats)} of {self.world_size} ranks are on this host)" if len(beats) < self.world_size else ""
        message = (
            f"hang: no progress for {limit:.0f} s; rank {worst['rank']} looks stuck in phase "
            f"'{worst['phase']}' of step {worst['step']} (last completed step {worst['last_completed_step']}; "
            f"{why}); {others or 'no other rank visible'}{seen}"
        )
        return message, silent

    def _fire(self, limit: float) -> None:
        message, silent = self.diagnose(limit)
        frozen = [b for b in silent if self._same_process(b)]
        if frozen:
            ranks = ", ".join(str(b["rank"]) for b in frozen)
            sys.stderr.write(
                f"[rank{self.rank}] killing rank(s) {ranks} after this one exits: they stopped reporting "
                f"and would not answer the agent's SIGTERM\n"
            )
            self._kill_after_exit([b["pid"] for b in frozen])
        sys.stderr.write(f"[rank{self.rank}] Python stacks of this rank:\n")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        # the diagnosis last: a rank log's last `[rank<r>]` line is the cause the CLI quotes (monitor/rank_logs.py)
        sys.stderr.write(f"[rank{self.rank}] {message}\n")
        sys.stderr.flush()
        os._exit(EXIT_HANG)  # the main thread is blocked in C++; only a hard exit gets out

    def _same_process(self, beat: dict) -> bool:
        """Whether the heartbeat's process is another live process of this host with the same start time (pids are
        reused)."""
        if beat["pid"] == os.getpid() or beat.get("host") != self._record["host"]:
            return False
        try:
            return abs(psutil.Process(beat["pid"]).create_time() - beat["started"]) < 0.01
        except psutil.Error:
            return False

    @staticmethod
    def _kill_after_exit(pids: list[int]) -> None:
        """SIGKILL `pids` once this process is gone and reaped: the agent then reports this rank's EXIT_HANG and its
        diagnosis, not the frozen rank's SIGKILL, and needs no SIGTERM grace for a process that cannot answer."""
        subprocess.Popen(
            [sys.executable, "-S", "-c", _KILLER, str(os.getpid()), *map(str, pids)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._publish(watching=False)
