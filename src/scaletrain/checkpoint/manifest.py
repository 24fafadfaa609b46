"""What makes a checkpoint folder complete: a manifest with the checksum of every file, written last.

Layout of a checkpoint directory (CKPT_ROOT = run folder's checkpoints/ unless checkpoint.dir is set):

    step_00000100.partial/      being written; never loaded, removed at the next start
    step_00000100/              committed: renamed from .partial after every rank finished and
        manifest.json           rank 0 wrote the checksums (sha256) of every other file
        trainer.json            step, schedule, data position, loss scaler: plain JSON, world-size free
        rng_rank<r>.json        each rank's RNG states
        .metadata, __*.distcp   torch.distributed.checkpoint's files (model + optimizer, any layout)
    step_00000100.corrupt-20261203-101500/
                                failed verification when a resume looked at it: set aside (kept for a post-mortem,
                                never loaded) so the same step can be saved again
    step_00000100.replaced-.../ a committed folder of an earlier run being replaced by this run's save of that step;
                                removed once the new one is committed

With SCALETRAIN_CHECKPOINT_KEY set in the environment, every manifest carries an HMAC-SHA256 over its contents
(which include every file's sha256), and verification refuses a checkpoint whose manifest is unsigned or whose
signature does not match: on a shared filesystem, someone who can write the folder but does not hold the key can
no longer rewrite data and checksums together.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

FORMAT = "scaletrain-dcp-1"
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step_(\d{8})$")
ASIDE_DIR = re.compile(r"^step_(\d{8})\.corrupt-[\d-]+$")
KEY_ENV = "SCALETRAIN_CHECKPOINT_KEY"


def _signature(manifest: dict, key: str) -> str:
    body = json.dumps({k: v for k, v in manifest.items() if k != "hmac"}, sort_keys=True).encode()
    return hmac.new(key.encode(), body, hashlib.sha256).hexdigest()


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(partial: Path, final: Path, info: dict) -> dict:
    """Checksum every file of `partial`, write the manifest, then rename to `final` (atomic on one filesystem)."""
    files: dict[str, dict] = {}
    for p in sorted(partial.iterdir()):
        if p.is_file() and p.name != MANIFEST:
            files[p.name] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
    manifest = {"format": FORMAT, **info, "files": files, "bytes": sum(f["bytes"] for f in files.values())}
    if os.environ.get(KEY_ENV):
        manifest["hmac"] = _signature(manifest, os.environ[KEY_ENV])
    tmp = partial / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, partial / MANIFEST)
    _fsync_dir(partial)
    old = None
    if final.exists():  # a folder of this step from an earlier run: swap, never write into it or skip the save
        old = final.with_name(f"{final.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        os.replace(final, old)
    os.replace(partial, final)
    _fsync_dir(final.parent)
    if old is not None:
        import shutil

        shutil.rmtree(old, ignore_errors=True)
    return manifest


def set_aside(path: Path) -> Path:
    """Rename a checkpoint that failed verification to `step_N.corrupt-<time>`: kept, never loaded or listed as a
    checkpoint, and its step can be saved again. Returns the new path."""
    aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
    n = 1
    while aside.exists():
        aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
        n += 1
    os.replace(path, aside)
    _fsync_dir(path.parent)
    return aside


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


def verify(path: Path, checksums: bool = True, metadata: bool | None = None) -> Verdict:
    """Is `path` a complete, intact, safe checkpoint? Checks presence and size of every file, the manifest's
    signature when SCALETRAIN_CHECKPOINT_KEY is set, the sha256 of every file if `checksums`, and (if `metadata`,
    by default when `checksums`) that DCP's pickled `.metadata` holds nothing but checkpoint metadata."""
    manifest = read_manifest(path)
    if manifest is None or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        return Verdict(path, False, "no valid manifest.json (incomplete or not a scaletrain checkpoint)")
    key = os.environ.get(KEY_ENV)
    if key:
        if "hmac" not in manifest:
            return Verdict(
                path,
                False,
                f"manifest.json is not signed but {KEY_ENV} is set (saved without the key, or rewritten)",
                manifest,
            )
        if not hmac.compare_digest(str(manifest["hmac"]), _signature(manifest, key)):
            return Verdict(
                path,
                False,
                f"manifest.json signature does not match {KEY_ENV} (tampered, or saved with another key)",
                manifest,
            )
    listed = set(manifest["files"])
    for p in path.iterdir():
        if p.name not in listed and p.name != MANIFEST:
            return Verdict(path, False, f"{p.name} is not in the manifest (added after the save)", manifest)
    for name, meta in manifest["files"].items():
        if "/" in name or name in (".", ".."):
            return Verdict(path, False, f"manifest.json names {name!r}, not a file of this folder", manifest)
        f = path / name
        if not f.is_file():
            return Verdict(path, False, f"{name} is missing", manifest)
        if f.stat().st_size != meta["bytes"]:
            return Verdict(
                path, False, f"{name} has {f.stat().st_size} bytes, manifest says {meta['bytes']} (truncated)", manifest
            )
        if checksums and sha256_file(f) != meta["sha256"]:
            return Verdict(path, False, f"{name} fails its sha256 checksum (corrupted)", manifest)
    if checksums if metadata is None else metadata:
        from scaletrain.checkpoint.safe_load import UnsafeCheckpoint, check_metadata

        try:
            check_metadata(path)
        except (UnsafeCheckpoint, OSError) as e:
            return Verdict(path, False, str(e), manifest)
    return Verdict(path, True, "", manifest)


def list_checkpoints(root: Path) -> list[Path]:
    """Committed-looking checkpoint folders (step_NNNNNNNN) under root, newest step first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def set_aside_dirs(root: Path) -> list[Path]:
    """Checkpoints a resume set aside as corrupt (`step_N.corrupt-<time>`), newest step first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p.name, p) for p in root.iterdir() if p.is_dir() and (m := ASIDE_DIR.match(p.name))]
    return [p for _, _, p in sorted(found, reverse=True)]


def partial_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.is_dir() and p.name.endswith(".partial")]
