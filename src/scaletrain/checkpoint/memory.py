"""In-memory snapshots (`checkpoint.memory_interval_steps`): every N steps each rank writes its own shard of the
model and optimizer into host memory, a tmpfs folder (/dev/shm by default; another with $SCALETRAIN_SNAPSHOT_DIR).
It outlives the worker processes, so when the ranks restart after a failure (the torchrun agent's new round, or an
in-process restart's new generation) they resume from it if it is newer than the newest disk checkpoint, losing at
most N steps instead of checkpoint.interval_steps. Durable checkpoints stay as they are; only the newest snapshot is
kept.

A snapshot is not a DCP checkpoint: each rank writes its local tensors (the DTensor shards it holds, keyed as the
checkpoint keys them) to one file, `rank<r>.pt`, with no collective planning, and reads back only its own file. So a
restart reads it only into the layout and world size that wrote it (snapshot.json records both); a run resumed in
another layout takes the newest disk checkpoint, which DCP reshards.

A snapshot is committed by renaming its folder; a marker in the disk checkpoint folder (`memory.json`) names it, so a
run folder deleted or started afresh never resumes from a stale snapshot of an earlier run. A successful run removes
its snapshots at the end. One node only for now: the peer copy that would let another node's ranks take over a lost
node's snapshot is not built (the config refuses memory snapshots with launch.nnodes > 1).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

SNAPSHOT_DIR_ENV = "SCALETRAIN_SNAPSHOT_DIR"
MARKER = "memory.json"
SNAPSHOT_INFO = "snapshot.json"  # the manifest of a snapshot: layout, world size, model, step


def rank_file(rank: int) -> str:
    """The file of `rank`'s shard in a snapshot folder."""
    return f"rank{rank}.pt"


def snapshot_root(ckpt_root: Path) -> Path:
    """The host-memory folder of the run whose disk checkpoints go to `ckpt_root`."""
    base = Path(os.environ.get(SNAPSHOT_DIR_ENV, "/dev/shm"))
    key = hashlib.sha256(str(ckpt_root.resolve()).encode()).hexdigest()[:16]
    return base / f"scaletrain-snapshots-{key}"


class MemorySnapshots:
    """Where a run's snapshots go and which one is current; the writing itself is CheckpointManager.snapshot."""

    def __init__(self, ckpt_root: Path, interval_steps: int):
        self.ckpt_root = ckpt_root
        self.dir = snapshot_root(ckpt_root)
        self.interval = interval_steps

    def due(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0

    def partial(self, step: int) -> Path:
        return self.dir / f"step_{step:08d}.partial"

    def commit(self, step: int) -> Path:
        """Rank 0, once every rank's files are written: rename into place, point the marker at it, drop older ones."""
        final = self.dir / f"step_{step:08d}"
        shutil.rmtree(final, ignore_errors=True)
        os.replace(self.partial(step), final)
        self.ckpt_root.mkdir(parents=True, exist_ok=True)
        tmp = self.ckpt_root / (MARKER + ".tmp")
        tmp.write_text(json.dumps({"step": step, "dir": str(final)}))
        os.replace(tmp, self.ckpt_root / MARKER)
        for old in self.dir.iterdir():
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def newest(self) -> tuple[int, Path, dict] | None:
        """Rank 0: (step, folder, its SNAPSHOT_INFO) of the snapshot the marker names, when it is whole; None
        otherwise."""
        marker = self.ckpt_root / MARKER
        try:
            named = json.loads(marker.read_text())
        except (OSError, ValueError):
            return None
        path = Path(named["dir"])
        if path.parent != self.dir or not (path / "trainer.json").is_file():
            return None
        try:
            info = json.loads((path / SNAPSHOT_INFO).read_text())
        except (OSError, ValueError):
            return None
        if not all((path / rank_file(r)).is_file() for r in range(int(info.get("world_size", 0)))):
            return None
        return int(named["step"]), path, info

    def clear(self) -> None:
        """Rank 0, after a successful run: free the host memory and forget the snapshot."""
        shutil.rmtree(self.dir, ignore_errors=True)
        (self.ckpt_root / MARKER).unlink(missing_ok=True)
