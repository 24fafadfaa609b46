"""Hang detection: every rank publishes a heartbeat (step, phase, time) and a background thread notices when its
own rank made no progress for too long. It then names the stuck rank from all heartbeats (the one whose
heartbeat went stale first, or which is furthest behind), dumps this rank's Python stacks, and exits EXIT_HANG
instead of waiting forever in a collective. The torchrun agent then restarts the group (launch.max_restarts) or
fails the job.

Heartbeats are small JSON files in RUN_DIR/heartbeat/ (shared by the ranks of one host; on several hosts each host
sees its own ranks and the message says so).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from pathlib import Path

EXIT_HANG = 124  # like timeout(1): the run stopped making progress


class Watchdog:
    def __init__(self, folder: Path, rank: int, world_size: int, timeout_s: float, first_step_timeout_s: float):
        self.folder = folder
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.first_step_timeout_s = first_step_timeout_s
        self.step, self.phase = 0, "start"
        self._last = time.monotonic()
        self._first_step: int | None = None
        self._first_step_done = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.enabled = timeout_s > 0

    def __enter__(self) -> Watchdog:
        if self.enabled:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._publish()
            self._thread = threading.Thread(target=self._run, name="scaletrain-watchdog", daemon=True)
            self._thread.start()
        return self

    def beat(self, step: int, phase: str) -> None:
        """Record progress: rank is now in `phase` of `step`. Cheap: no I/O on the training thread."""
        if self._first_step is None:
            self._first_step = step
        elif step > self._first_step:
            self._first_step_done = True  # start-up, first compile and first collectives are behind us
        self.step, self.phase, self._last = step, phase, time.monotonic()

    def _publish(self) -> None:
        record = {"rank": self.rank, "step": self.step, "phase": self.phase, "pid": os.getpid(),
                  "progress_age_s": round(time.monotonic() - self._last, 3), "time": time.time()}
        tmp = self.folder / f".rank{self.rank}.json.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.folder / f"rank{self.rank}.json")

    def _run(self) -> None:
        period = max(0.2, min(5.0, self.timeout_s / 5))
        while not self._stop.wait(period):
            try:
                self._publish()
            except OSError:
                pass
            limit = self.timeout_s if self._first_step_done else self.first_step_timeout_s
            if time.monotonic() - self._last > limit:
                self._fire(limit)

    def diagnose(self, limit: float) -> str:
        """One line naming the stuck rank from every heartbeat this host can see."""
        now = time.time()
        beats = []
        for p in sorted(self.folder.glob("rank*.json")):
            try:
                beats.append(json.loads(p.read_text()))
            except (OSError, ValueError):
                continue
        # a heartbeat file that stopped being rewritten means that process is frozen or gone
        for b in beats:
            b["silent_s"] = now - b["time"]
        silent = [b for b in beats if b["silent_s"] > 3 * max(0.2, min(5.0, self.timeout_s / 5))]
        if silent:
            worst = max(silent, key=lambda b: b["silent_s"])
            why = f"its process stopped reporting {worst['silent_s']:.0f} s ago"
        else:
            worst = min(beats, key=lambda b: (b["step"], -b["progress_age_s"])) if beats else \
                {"rank": self.rank, "step": self.step, "phase": self.phase}
            why = "it is furthest behind"
        others = ", ".join(f"rank {b['rank']}: step {b['step']} {b['phase']}" for b in beats
                           if b["rank"] != worst["rank"])
        seen = f" ({len(beats)} of {self.world_size} ranks visible from this host)" \
            if len(beats) < self.world_size else ""
        return (f"hang: no progress for {limit:.0f} s; rank {worst['rank']} looks stuck at step {worst['step']} "
                f"in phase '{worst['phase']}' ({why}); others: {others or '-'}{seen}")

    def _fire(self, limit: float) -> None:
        message = self.diagnose(limit)
        sys.stderr.write(f"[rank{self.rank}] {message}\n[rank{self.rank}] Python stacks of this rank:\n")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(EXIT_HANG)  # the main thread is blocked in C++; only a hard exit gets out

    def __exit__(self, *exc) -> None:
        self._stop.set()
