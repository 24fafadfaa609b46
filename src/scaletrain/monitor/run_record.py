"""One run per run folder. A fresh run (start step 0: no checkpoint to resume from) starts every file a run writes
anew, as metrics.jsonl always did; a resumed run continues them. monitor/run.json says which run the folder holds:
when it started and each attempt (the first start, then every resume), so the report can name the run and mark the
restarts, and every rank's samples share one time base that keeps going forward across attempts.

    run = begin_run(out, rank, start_step)     # every rank, before any run file is opened (one broadcast)
    run.resumed, run.started_at, run.t()       # seconds since the run started, on every rank
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

RUN_FILE = Path("monitor") / "run.json"
# what an earlier run in the same folder left beside metrics.jsonl (rewritten by open_sinks); checkpoints and the
# rank logs (one section per attempt, appended by the launcher before a rank knows whether it resumes) are not
PREVIOUS_RUN_OUTPUTS = ("summary.json", "report.html", "monitor", "profile", "tensorboard", "wandb")


@dataclass(frozen=True)
class RunRecord:
    """started_at: Unix seconds of the run's first attempt; attempts: one dict per attempt, `started_at` (Unix
    seconds), `t_s` (seconds since the run started) and `start_step` (0 for the first, the resumed step after)."""

    started_at: float
    attempts: tuple[dict, ...] = field(default_factory=tuple)
    # samples files continue (a resumed run whose folder says when it started) or start anew
    continue_files: bool = False

    @property
    def resumed(self) -> bool:
        return len(self.attempts) > 1

    def t(self, now: float | None = None) -> float:
        """Seconds since the run started (the time base of samples and metric records)."""
        return (time.time() if now is None else now) - self.started_at

    def to_json(self) -> str:
        return json.dumps({"started_at": self.started_at, "attempts": list(self.attempts)}, indent=1) + "\n"


def is_resumed(start_step: int) -> bool:
    """The rule every run file follows: a run that starts past step 0 resumed from a checkpoint and continues the
    folder's files; one that starts at 0 is a fresh run and starts them anew."""
    return start_step > 0


def read_run_record(run_dir: Path) -> RunRecord | None:
    """The folder's monitor/run.json, or None when missing or unreadable (folders written before it existed)."""
    try:
        tree = json.loads((Path(run_dir) / RUN_FILE).read_text())
        return RunRecord(float(tree["started_at"]), tuple(tree["attempts"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _start_on_rank0(out: Path, start_step: int) -> RunRecord:
    now = time.time()
    previous = read_run_record(out) if is_resumed(start_step) else None
    if previous is None:  # a fresh run, or a resume in a folder that never said when its run started
        if not is_resumed(start_step):
            for name in PREVIOUS_RUN_OUTPUTS:
                path = out / name
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
        run = RunRecord(now, ({"started_at": now, "t_s": 0.0, "start_step": start_step},))
    else:
        attempt = {"started_at": now, "t_s": round(now - previous.started_at, 3), "start_step": start_step}
        run = RunRecord(previous.started_at, (*previous.attempts, attempt), continue_files=True)
    (out / RUN_FILE).parent.mkdir(parents=True, exist_ok=True)
    (out / RUN_FILE).write_text(run.to_json())
    return run


def begin_run(out: Path, rank: int, start_step: int) -> RunRecord:
    """Rank 0 clears an earlier run's outputs (fresh run) or adds an attempt (resumed) and writes monitor/run.json;
    every rank gets the same record. Call on every rank, before any run file is opened: the broadcast keeps the
    other ranks from opening theirs before rank 0 has cleared the folder."""
    return from_rank0(lambda: _start_on_rank0(out, start_step), rank)


def from_rank0(make, rank: int):
    """`make()` run on rank 0 only, its result handed to every rank (one broadcast when there are several)."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return make()
    box = [make() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
