"""Where tokens come from: a prepared dataset folder, a Megatron .bin/.idx pair, a flat token file, this Python's
standard library sources as bytes, or synthetic ids. Every one opens as a `Dataset`: memory-mapped train and
validation TokenStreams (stdlib bytes and synthetic ids, a few MB, are held in memory) that the same loader reads.

A prepared dataset brings its own validation split (whole documents); the other sources hold out the tail
data.val_fraction of their stream. A source that has files keeps its index arrays in a cache folder: data.cache_dir,
else `.scaletrain-cache` beside the data, else (a read-only data folder) ~/.cache/scaletrain/data/<hash of path>.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from scaletrain.config.folders import user_cache_dir
from scaletrain.config.schema import DataConfig, MixEntry
from scaletrain.data.manifest import DatasetError, DatasetManifest, is_prepared
from scaletrain.data.megatron import MegatronIndex, open_megatron, prefix_of
from scaletrain.data.shards import open_prepared
from scaletrain.data.stream import TokenStream

CACHE_NAME = ".scaletrain-cache"


def stdlib_files() -> list[Path]:
    """The .py files of this interpreter's standard library, in a fixed (sorted path) order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "__pycache__"}
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]  # prune: the test suites are most of the tree
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_documents(max_bytes: int) -> tuple[bytes, np.ndarray]:
    """Concatenated stdlib sources, up to max_bytes, each file followed by a blank line; and each file's start."""
    out = bytearray()
    starts = []
    for path in stdlib_files():
        if len(out) >= max_bytes:
            break
        starts.append(len(out))
        out += path.read_bytes() + b"\n\n"
    return bytes(out[:max_bytes]), np.asarray(starts[1:], dtype=np.int64)


def stdlib_bytes(max_bytes: int) -> bytes:
    """Concatenated stdlib sources, up to max_bytes, each file separated by a blank line."""
    return stdlib_documents(max_bytes)[0]


@dataclass
class Dataset:
    """One opened source. kind: prepared, megatron, tokens, stdlib or synthetic."""

    name: str
    kind: str
    path: Path | None
    train: TokenStream
    val: TokenStream
    cache_dir: Path | None = None
    manifest: DatasetManifest | None = None
    megatron: MegatronIndex | None = None
    dtype: np.dtype | None = None  # of the token file (tokens, megatron)

    @property
    def has_documents(self) -> bool:
        return self.train.has_documents


def split_tail(stream: TokenStream, val_fraction: float) -> tuple[TokenStream, TokenStream]:
    """(head, tail) with the tail max(1, int(n · val_fraction)) tokens."""
    n = stream.num_tokens
    n_val = min(n, max(1, int(n * val_fraction)))
    return stream.view(0, n - n_val), stream.view(n - n_val, n)


def cache_folder(data_path: Path, configured: str | None) -> Path:
    """Where a dataset's index arrays go (see the module docstring); not created here."""
    key = hashlib.sha256(str(data_path.resolve()).encode()).hexdigest()[:16]
    if configured:
        return Path(configured) / f"{data_path.name}-{key}"
    beside = data_path if data_path.is_dir() else data_path.parent
    existing = beside / CACHE_NAME
    # a file (or anything not a folder) where the cache folder goes is not a cache: cache in the home cache instead
    usable = existing.is_dir() or not (existing.exists() or existing.is_symlink())
    if usable and os.access(existing if existing.is_dir() else beside, os.W_OK):
        return existing
    return user_cache_dir() / "data" / f"{data_path.name}-{key}"


def detect_kind(path: str) -> str:
    """prepared, megatron or tokens for a path given with source=auto; DatasetError when it is none of them."""
    p = Path(path)
    if p.is_dir():
        if is_prepared(p):
            return "prepared"
        raise DatasetError(f"{path!r} is a folder without manifest.json, not a prepared dataset")
    if prefix_of(p) is not None:
        return "megatron"
    if p.is_file():
        return "tokens"
    raise DatasetError(f"{path!r} does not exist")


def open_file_dataset(name: str, entry: MixEntry, cfg: DataConfig) -> Dataset:
    """A dataset with files (prepared, megatron or a flat token file); DatasetError for anything unusable."""
    kind = detect_kind(entry.path) if entry.source == "auto" else entry.source
    path = Path(entry.path)
    if kind == "prepared":
        manifest, streams = open_prepared(path)
        train = streams.get("train", TokenStream([]))
        val = streams.get("val", TokenStream([]))
        if val.num_tokens <= cfg.seq_len:  # no usable val split: hold out the tail as the other sources do
            train, val = split_tail(train, cfg.val_fraction)
        return Dataset(name, kind, path, train, val, cache_folder(path, cfg.cache_dir), manifest=manifest)
    if kind == "megatron":
        prefix = prefix_of(path)
        if prefix is None:
            raise DatasetError(f"{entry.path!r}: no PREFIX.bin and PREFIX.idx pair there")
        cache = cache_folder(prefix.with_name(prefix.name + ".bin"), cfg.cache_dir)
        index, stream = open_megatron(prefix, cache)
        train, val = split_tail(stream, cfg.val_fraction)
        return Dataset(name, kind, path, train, val, cache, megatron=index, dtype=index.dtype)
    if not path.is_file():
        raise DatasetError(f"{entry.path!r} does not exist; point it at a flat file of token ids")
    dtype = np.dtype(entry.token_dtype).newbyteorder("<")
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise DatasetError(
            f"{entry.path!r} has {size} bytes, not a whole number of {entry.token_dtype} tokens; check data.token_dtype"
        )
    n = size // dtype.itemsize
    try:
        tokens = np.memmap(path, mode="r", dtype=dtype, shape=(n,)) if n else np.empty(0, dtype)
    except OSError as e:
        raise DatasetError(f"{entry.path!r}: cannot read ({e.strerror})") from e
    train, val = split_tail(TokenStream.of(tokens), cfg.val_fraction)
    return Dataset(name, "tokens", path, train, val, cache_folder(path, cfg.cache_dir), dtype=dtype)


def open_datasets(cfg: DataConfig, vocab_size: int, seed: int) -> list[Dataset]:
    """Every dataset of the data section, in data.mix order (one without a mix). Errors name the field."""
    if cfg.mix:
        out = []
        for name, entry in cfg.datasets():
            try:
                out.append(open_file_dataset(name, entry, cfg))
            except DatasetError as e:
                raise DatasetError(f"data.mix.{name}: {e}") from None
        return out
    kind = cfg.source if cfg.source != "auto" else ("stdlib" if cfg.path is None else "file")
    if kind == "stdlib":
        data, starts = stdlib_documents(cfg.max_bytes)
        stream = TokenStream.of(np.frombuffer(data, dtype=np.uint8), starts)
        train, val = split_tail(stream, cfg.val_fraction)
        return [Dataset("stdlib", "stdlib", None, train, val)]
    if kind == "synthetic":
        gen = torch.Generator().manual_seed(seed + 7919)
        ids = torch.randint(0, vocab_size, (cfg.synthetic_tokens,), generator=gen).numpy()
        train, val = split_tail(TokenStream.of(ids), cfg.val_fraction)
        return [Dataset("synthetic", "synthetic", None, train, val)]
    assert cfg.path is not None  # the config refuses file sources without data.path
    source = cfg.source if cfg.source != "auto" else "auto"
    entry = MixEntry(path=cfg.path, weight=1.0, source=source, token_dtype=cfg.token_dtype)  # type: ignore[arg-type]
    try:
        return [open_file_dataset(cfg.path, entry, cfg)]
    except DatasetError as e:
        raise DatasetError(f"data.path: {e}") from None
