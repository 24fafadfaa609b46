"""What makes a checkpoint folder complete: a manifest with the checksum of every file, written last.

Layout of a checkpoint directory (CKPT_ROOT = run folder's checkpoints/ unless checkpoint.dir is set):

    step_00000100.partial/      being written; never loaded, removed at the next start
    step_00000100/              committed: renamed from .partial after every rank finished and
        manifest.json           rank 0 wrote the checksums (sha256) of every other file
        trainer.json            step, schedule, data position, loss scaler: plain JSON, world-size free
        rng_rank<r>.json        each rank's RNG states
        .metadata, __*.distcp   torch.distributed.checkpoint's files (model + optimizer, any layout)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

FORMAT = "scaletrain-dcp-1"
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(partial: Path, final: Path, info: dict) -> dict:
    """Checksum every file of `partial`, write the manifest, then rename to `final` (atomic on one filesystem)."""
    files = {}
    for p in sorted(partial.iterdir()):
        if p.is_file() and p.name != MANIFEST:
            files[p.name] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
    manifest = {"format": FORMAT, **info, "files": files, "bytes": sum(f["bytes"] for f in files.values())}
    tmp = partial / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, partial / MANIFEST)
    _fsync_dir(partial)
    os.replace(partial, final)
    _fsync_dir(final.parent)
    return manifest


@dataclass
class Verdict:
    path: Path
    ok: bool
    problem: str = ""
    manifest: dict | None = None


def read_manifest(path: Path) -> dict | None:
    try:
        return json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def verify(path: Path, checksums: bool = True) -> Verdict:
    """Is `path` a complete, intact checkpoint? Checks presence and size of every file, and sha256 if asked."""
    manifest = read_manifest(path)
    if manifest is None or manifest.get("format") != FORMAT:
        return Verdict(path, False, "no valid manifest.json (incomplete or not a scaletrain checkpoint)")
    for name, meta in manifest["files"].items():
        f = path / name
        if not f.is_file():
            return Verdict(path, False, f"{name} is missing", manifest)
        if f.stat().st_size != meta["bytes"]:
            return Verdict(path, False, f"{name} has {f.stat().st_size} bytes, manifest says {meta['bytes']} "
                                        "(truncated)", manifest)
        if checksums and sha256_file(f) != meta["sha256"]:
            return Verdict(path, False, f"{name} fails its sha256 checksum (corrupted)", manifest)
    return Verdict(path, True, "", manifest)


def list_checkpoints(root: Path) -> list[Path]:
    """Committed-looking checkpoint folders (step_NNNNNNNN) under root, newest step first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)), reverse=True)


def partial_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.is_dir() and p.name.endswith(".partial")]
