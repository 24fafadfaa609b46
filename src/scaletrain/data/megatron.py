"""Megatron-LM / NeMo indexed datasets (PREFIX.bin + PREFIX.idx), read directly through memory maps.

The .idx layout (megatron/core/datasets/indexed_dataset.py, version 1), all little-endian:
    9 bytes  b"MMIDIDX\\x00\\x00"
    uint64   version (1)
    uint8    dtype code of the .bin: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    uint64   sequence count S
    uint64   document count D (entries of the document index: documents + 1)
    int32[S] sequence lengths (tokens)
    int64[S] sequence pointers (byte offsets into .bin)
    int64[D] document indices: document d is sequences [idx[d], idx[d+1])
The .bin is the sequences' tokens back to back, read here as one stream; documents begin at the pointers of their
first sequences.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scaletrain.data.manifest import DatasetError
from scaletrain.data.order import cached_array
from scaletrain.data.stream import Segment, TokenStream

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}
_FIXED = len(HEADER) + 8 + 1 + 8 + 8


def prefix_of(path: str | Path) -> Path | None:
    """PREFIX when `path` is PREFIX, PREFIX.bin or PREFIX.idx and both files exist, else None."""
    p = Path(path)
    prefix = p.with_suffix("") if p.suffix in (".bin", ".idx") else p
    if prefix.with_name(prefix.name + ".bin").is_file() and prefix.with_name(prefix.name + ".idx").is_file():
        return prefix
    return None


@dataclass
class MegatronIndex:
    prefix: Path
    dtype: np.dtype
    lengths: np.ndarray  # int32[S], memory-mapped
    pointers: np.ndarray  # int64[S], memory-mapped
    doc_index: np.ndarray  # int64[D], memory-mapped

    @property
    def bin_path(self) -> Path:
        return self.prefix.with_name(self.prefix.name + ".bin")

    @property
    def num_tokens(self) -> int:
        return self.bin_path.stat().st_size // self.dtype.itemsize

    @property
    def num_documents(self) -> int:
        return max(0, len(self.doc_index) - 1)


def read_index(prefix: Path) -> MegatronIndex:
    """Parse PREFIX.idx and check it against PREFIX.bin's size; DatasetError (one line naming the file) else."""
    idx = prefix.with_name(prefix.name + ".idx")
    try:
        with open(idx, "rb") as f:
            head = f.read(_FIXED)
        size = idx.stat().st_size
        bin_size = prefix.with_name(prefix.name + ".bin").stat().st_size
    except OSError as e:
        raise DatasetError(f"{idx}: cannot read ({e.strerror})") from e
    if len(head) < _FIXED or head[: len(HEADER)] != HEADER:
        raise DatasetError(f"{idx}: not a Megatron indexed dataset (no MMIDIDX header)")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[len(HEADER) :])
    if version != VERSION:
        raise DatasetError(f"{idx}: Megatron index version {version}, this reads version {VERSION}")
    if code not in DTYPES:
        raise DatasetError(f"{idx}: unknown dtype code {code} (known: {sorted(DTYPES)})")
    dtype = np.dtype(DTYPES[code])
    if dtype.kind == "f":
        raise DatasetError(f"{idx}: the .bin holds {dtype.name} values, not token ids")
    if size != _FIXED + 12 * n_seq + 8 * n_doc and size != _FIXED + 13 * n_seq + 8 * n_doc:  # + int8 modes
        raise DatasetError(f"{idx}: {size} bytes do not match {n_seq} sequences and {n_doc} document entries")
    mm = np.memmap(idx, mode="r", dtype=np.uint8)
    lengths = mm[_FIXED : _FIXED + 4 * n_seq].view("<i4")
    pointers = mm[_FIXED + 4 * n_seq : _FIXED + 12 * n_seq].view("<i8")
    doc_index = mm[_FIXED + 12 * n_seq : _FIXED + 12 * n_seq + 8 * n_doc].view("<i8")
    if n_seq:
        first, end = int(pointers[0]), int(pointers[-1]) + int(lengths[-1]) * dtype.itemsize
        if first != 0 or end != bin_size:
            raise DatasetError(
                f"{idx}: the sequences span bytes [{first}, {end}) but the .bin has {bin_size}; "
                "the .bin and .idx do not belong together"
            )
    elif bin_size:
        raise DatasetError(f"{idx}: no sequences, but the .bin has {bin_size} bytes")
    return MegatronIndex(prefix, dtype, lengths, pointers, doc_index)


def document_starts(index: MegatronIndex, chunk: int = 1 << 22) -> np.ndarray:
    """Byte pointer of each document's first sequence (int64, ascending), computed in chunks."""
    starts = index.doc_index[:-1]
    out = np.empty(len(starts), dtype=np.int64)
    for a in range(0, len(starts), chunk):
        out[a : a + chunk] = index.pointers[np.asarray(starts[a : a + chunk])]
    return out


def open_megatron(prefix: Path, cache_dir: Path | None) -> tuple[MegatronIndex, TokenStream]:
    """The .bin as one memory-mapped stream with its document starts (cached in cache_dir when given)."""
    index = read_index(prefix)
    n = index.num_tokens
    tokens = np.memmap(index.bin_path, mode="r", dtype=index.dtype, shape=(n,)) if n else np.empty(0, index.dtype)
    idx_stat = prefix.with_name(prefix.name + ".idx").stat()
    if cache_dir is None:
        starts = document_starts(index)
    else:
        name = f"{prefix.name}.docstarts-{idx_stat.st_size}-{idx_stat.st_mtime_ns}.npy"
        starts = cached_array(cache_dir / name, lambda: document_starts(index))
    return index, TokenStream([Segment(tokens, starts, index.dtype.itemsize)])
