"""A prepared dataset folder (manifest.py's format) opened as memory-mapped token streams, one per split (with
their loss masks, for chat and prompt-completion data).

Checks on opening are the cheap ones (the manifest's format and version, every file's size); the sha256 of every
shard is checked by `verify_prepared` on a dataset's first use and remembered by a stamp in the cache folder keyed
by the manifest's own hash, so a TB-scale dataset is hashed once, not at every job start (data.checksums).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from scaletrain.data.manifest import (
    DOCS_DTYPE,
    MANIFEST,
    MASK_DTYPE,
    DatasetManifest,
    check_shard_sizes,
    read_manifest,
    verify_shards,
)
from scaletrain.data.stream import Segment, TokenStream


def _map(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    return np.memmap(path, mode="r", dtype=dtype, shape=(count,)) if count else np.empty(0, dtype)


def open_prepared(folder: Path) -> tuple[DatasetManifest, dict[str, TokenStream]]:
    """The manifest and each split's stream; DatasetError (one line naming the file) for anything unusable."""
    manifest = read_manifest(folder)
    check_shard_sizes(folder, manifest)
    dtype = np.dtype(manifest.dtype).newbyteorder("<")
    streams = {}
    for name, split in manifest.splits.items():
        segments = [
            Segment(
                _map(folder / s.tokens, dtype, s.num_tokens),
                _map(folder / s.docs, DOCS_DTYPE, s.num_documents),
                mask=None if s.mask is None else _map(folder / s.mask, MASK_DTYPE, s.num_tokens),
            )
            for s in split.shards
            if s.num_tokens
        ]
        streams[name] = TokenStream(segments)
    return manifest, streams


def verify_prepared(folder: Path, manifest: DatasetManifest, cache_dir: Path | None, always: bool) -> None:
    """Check every shard's sha256 unless a stamp says this manifest already passed (always: check regardless)."""
    key = hashlib.sha256((folder / MANIFEST).read_bytes()).hexdigest()[:32]
    stamp = cache_dir / f"verified-{key}" if cache_dir is not None else None
    if not always and stamp is not None and stamp.is_file():
        return
    verify_shards(folder, manifest)
    if stamp is not None:
        try:
            stamp.parent.mkdir(parents=True, exist_ok=True)
            stamp.touch()
        except OSError:
            pass  # a read-only cache only costs the check again next time
