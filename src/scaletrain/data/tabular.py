"""Prepared tabular datasets for click-log recommenders (DLRM-style): dense features, categorical ids and a 0/1 label
per row, as flat arrays that numpy memory-maps.

Layout of a prepared folder (`scaletrain data prepare --format tabular`, data/tabular_prepare.py):

    manifest.json      {"format": "tabular", "label": ..., "dense": [...], "sparse": [...], "splits": {...}, ...}
    train/dense.npy    float32 (N, D): the dense columns, missing as 0, then the manifest's dense_transform
    train/sparse.npy   int64 (N, T): one id per categorical column (sparse_ids below)
    train/labels.npy   float32 (N,): 0 or 1
    val/...            the same for the validation split

`np.load(path, mmap_mode="r")` reads any of them without loading it. A categorical value's id is a stable 63-bit
hash of its string form (the same on every run and machine, in every input format), a missing value's id is
MISSING_ID; the model takes `id % table_rows` (the hashing trick), so ids only need to be stable and well spread.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

FORMAT = "tabular"
VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
ARRAYS = ("dense", "sparse", "labels")  # {split}/{name}.npy
MISSING_ID = 0  # the id of a missing categorical value (a present one hashes to it with probability 2**-63)
# FNV-1a 64 (http://www.isthe.com/chongo/tech/comp/fnv/) over the UTF-8 bytes, then MurmurHash3's fmix64 finaliser
# (github.com/aappleby/smhasher, MurmurHash3.cpp) so that the low bits `id % table_rows` keeps are well mixed
HASH = "fmix64(fnv1a64(utf-8 string form)) >> 1"
_FNV_OFFSET, _FNV_PRIME = np.uint64(0xCBF29CE484222325), np.uint64(0x100000001B3)
_FMIX = (np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53))
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio, SplitMix64's increment


class TabularDataError(ValueError):
    """A prepared tabular folder cannot be read; the message is one line naming the path."""


@dataclass
class TabularManifest:
    label_col: str
    dense_cols: list[str]
    sparse_cols: list[str]
    splits: dict[str, dict]  # split -> {"samples": n, "positives": rows labelled 1}
    distinct_ids: dict[str, int]  # sparse column -> distinct ids in train (at least this many when capped)
    capped: list[str] = field(default_factory=list)  # sparse columns whose count stopped at the prepare's cap
    dense_transform: str = "log1p"
    sources: list[dict] = field(default_factory=list)  # {"path", "format", "rows"} per input, in order
    created_by: str = ""
    version: int = VERSION

    @property
    def num_dense(self) -> int:
        return len(self.dense_cols)

    @property
    def num_sparse(self) -> int:
        return len(self.sparse_cols)

    def to_json(self) -> str:
        sparse_ids = {c: {"distinct": self.distinct_ids[c], "capped": c in self.capped} for c in self.sparse_cols}
        body = {"format": FORMAT, "version": self.version, "label": self.label_col, "dense": self.dense_cols,
                "sparse": self.sparse_cols, "splits": self.splits, "sparse_ids": sparse_ids,
                "dense_transform": self.dense_transform, "hash": HASH, "missing_id": MISSING_ID,
                "sources": self.sources, "created_by": self.created_by}  # fmt: skip
        return json.dumps(body, indent=1) + "\n"


def is_tabular_folder(path: str | Path) -> bool:
    """Whether `path` is a prepared tabular dataset (its manifest says format "tabular")."""
    try:
        return json.loads((Path(path) / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def read_tabular_manifest(folder: str | Path, field: str = "data.path") -> TabularManifest:
    """The manifest of a prepared tabular folder; TabularDataError (one line naming `field`) when it is not one."""
    path = Path(folder) / MANIFEST
    fix = "prepare it with `scaletrain data prepare --format tabular`"
    try:
        body = json.loads(path.read_text())
    except OSError:
        raise TabularDataError(f"{field}: {folder} has no {MANIFEST}; {fix}") from None
    except ValueError as e:
        raise TabularDataError(f"{field}: {path} is not valid JSON ({e})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        found = body.get("format", "tokens") if isinstance(body, dict) else "?"
        raise TabularDataError(f"{field}: {folder} is not a tabular dataset (its manifest's format is "
                               f"{found!r}); {fix}")  # fmt: skip
    if int(body.get("version", 0)) > VERSION:
        raise TabularDataError(f"{field}: {folder} was written by a newer scaletrain (tabular version "
                               f"{body['version']}, this one reads {VERSION}); upgrade scaletrain")  # fmt: skip
    try:
        ids = body["sparse_ids"]
        return TabularManifest(str(body["label"]), list(body["dense"]), list(body["sparse"]), dict(body["splits"]),
                               {c: int(v["distinct"]) for c, v in ids.items()}, [c for c, v in ids.items() if v["capped"]],
                               str(body["dense_transform"]), list(body.get("sources", [])),
                               str(body.get("created_by", "")), int(body["version"]))  # fmt: skip
    except (KeyError, TypeError, ValueError) as e:
        raise TabularDataError(f"{field}: {path} lacks or garbles the field {e}; prepare the folder again") from None


def open_split(folder: str | Path, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dense, sparse, labels) of one split, memory-mapped; TabularDataError when a file is missing or its shape
    disagrees with the manifest."""
    manifest = read_tabular_manifest(folder)
    if split not in manifest.splits:
        raise TabularDataError(f"{folder}: no split {split!r} (it has {', '.join(manifest.splits)})")
    n = int(manifest.splits[split]["samples"])
    shapes = {"dense": (n, manifest.num_dense), "sparse": (n, manifest.num_sparse), "labels": (n,)}
    arrays = []
    for name in ARRAYS:
        path = Path(folder) / split / f"{name}.npy"
        try:
            array = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise TabularDataError(f"{path}: unreadable ({e}); prepare the folder again") from None
        if array.shape != shapes[name]:
            raise TabularDataError(f"{path}: shape {array.shape}, the manifest says {shapes[name]}; prepare the "
                                   f"folder again")  # fmt: skip
        arrays.append(array)
    return arrays[0], arrays[1], arrays[2]


def _fmix64(h: np.ndarray) -> np.ndarray:
    h ^= h >> np.uint64(33)
    h *= _FMIX[0]
    h ^= h >> np.uint64(33)
    h *= _FMIX[1]
    h ^= h >> np.uint64(33)
    return h


def sparse_ids(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """int64 ids in [0, 2**63) of categorical values: HASH of each value's string form (pyarrow's cast to string:
    the text as written for CSV and TSV, "123" for an integer 123 in Parquet or JSON), MISSING_ID for a null.
    Vectorised over the values, one numpy pass per byte position of the longest value."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    strings = values.cast(pa.large_string())
    n = len(strings)
    _, offsets_buf, data_buf = strings.buffers()
    assert offsets_buf is not None
    offsets = np.frombuffer(offsets_buf, dtype=np.int64)[strings.offset : strings.offset + n + 1]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    starts, lengths = offsets[:-1], np.diff(offsets)
    h = np.full(n, _FNV_OFFSET, dtype=np.uint64)
    for pos in range(int(lengths.max(initial=0))):
        rows = np.flatnonzero(lengths > pos)
        h[rows] = (h[rows] ^ data[starts[rows] + pos]) * _FNV_PRIME
    ids = (_fmix64(h) >> np.uint64(1)).astype(np.int64)
    if strings.null_count:
        ids[np.asarray(strings.is_null())] = MISSING_ID
    return ids


def row_hash_unit(rows: np.ndarray) -> np.ndarray:
    """A uniform number in [0, 1) per row index (float64, fmix64 of the index plus a constant): the split's coin."""
    h = rows.astype(np.uint64) + _GOLDEN  # without it row 0 would hash to 0, always held out
    return (_fmix64(h) >> np.uint64(11)).astype(np.float64) * 2.0**-53
