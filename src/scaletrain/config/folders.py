"""Folders scaletrain writes to: output folders, checked before any work starts (a run folder or a prepared
dataset's folder that cannot be written fails in one line naming the setting, instead of after the ranks or the
tokenizer workers started), and this user's cache folder."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def check_writable_folder(path: str | Path, name: str) -> None:
    """ValueError (one line naming the setting `name`) unless `path` is a folder this process can write in, or one
    it can create: its nearest existing ancestor must be a folder where a folder can be made. Tried for real (a
    probe folder made and removed at once) rather than read from permission bits, which root, read-only mounts and
    /proc answer wrongly. Leaves nothing behind and creates nothing."""
    target = Path(path).absolute()
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{name}: {existing} is a file, so {target} cannot be a folder; choose another path")
    try:
        probe = tempfile.mkdtemp(prefix=".scaletrain-write-check-", dir=existing)
    except OSError as e:
        raise ValueError(
            f"{name}: cannot create folders in {existing} ({e.strerror}); choose a folder you can write"
        ) from None
    os.rmdir(probe)


def user_cache_dir() -> Path:
    """This user's cache folder for scaletrain's per-host files (data index arrays, measured peaks):
    $XDG_CACHE_HOME/scaletrain, default ~/.cache/scaletrain."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "scaletrain"
