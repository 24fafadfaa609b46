"""Test helper (not a test): writes datasets from their format definitions, as a user's tools would.

write_prepared follows src/scaletrain/data/manifest.py (token shards, document ends, manifest written last);
write_megatron follows the MMIDIDX index layout of Megatron-LM's megatron/core/datasets/indexed_dataset.py,
written here byte by byte with struct, independently of scaletrain's reader.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from scaletrain.data.manifest import (
    DOCS_DTYPE,
    MASKED_VERSION,
    PLAIN_VERSION,
    DatasetManifest,
    Shard,
    Split,
    TokenizerInfo,
    sha256_file,
    token_dtype,
    write_manifest,
)


def write_prepared(
    folder: Path,
    splits: dict[str, list[list[int]]],
    vocab_size: int = 256,
    docs_per_shard: int = 3,
    eos_id: int | None = None,
    trained: dict[str, list[list[int]]] | None = None,
) -> DatasetManifest:
    """A prepared dataset of the given documents per split (eos_id appended to each when given); `trained`: a loss
    mask (1: trained) per document of each split, as chat data stores it (then no eos_id)."""
    dtype = token_dtype(vocab_size)
    out: dict[str, Split] = {}
    for name, docs in splits.items():
        (folder / name).mkdir(parents=True, exist_ok=True)
        split = Split()
        for k, first in enumerate(range(0, max(len(docs), 1), docs_per_shard)):
            group = [list(d) + ([eos_id] if eos_id is not None else []) for d in docs[first : first + docs_per_shard]]
            tokens = np.asarray([t for d in group for t in d], dtype=dtype)
            ends = np.cumsum([len(d) for d in group]).astype(DOCS_DTYPE)
            tok_name, doc_name = f"{name}/shard-{k:05d}.tokens", f"{name}/shard-{k:05d}.docs"
            tokens.tofile(folder / tok_name)
            ends.tofile(folder / doc_name)
            mask_name, mask_sha, num_trained = None, None, None
            if trained is not None:
                mask = np.asarray([m for d in trained[name][first : first + docs_per_shard] for m in d], dtype=np.uint8)
                mask_name = f"{name}/shard-{k:05d}.mask"
                mask.tofile(folder / mask_name)
                mask_sha, num_trained = sha256_file(folder / mask_name), int(mask.sum())
            split.shards.append(
                Shard(
                    tok_name,
                    doc_name,
                    len(tokens),
                    len(group),
                    sha256_file(folder / tok_name),
                    sha256_file(folder / doc_name),
                    mask_name,
                    mask_sha,
                    num_trained,
                )
            )
        out[name] = split
    manifest = DatasetManifest(
        dtype=dtype.name,
        tokenizer=TokenizerInfo("bytes", "bytes", "0" * 64, vocab_size, eos_id),
        splits=out,
        created_by="tests/data_helpers.py",
        version=MASKED_VERSION if trained is not None else PLAIN_VERSION,
    )
    write_manifest(folder, manifest)
    return manifest


def write_megatron(prefix: Path, documents: list[list[list[int]]], code: int = 8, dtype: str = "<u2") -> None:
    """PREFIX.bin/.idx of documents, each a list of sequences (lists of ids); dtype code 8 is uint16."""
    seqs = [s for doc in documents for s in doc]
    lengths = [len(s) for s in seqs]
    itemsize = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype("<i8") * itemsize
    doc_index = np.concatenate([[0], np.cumsum([len(d) for d in documents])]).astype("<i8")
    np.asarray([t for s in seqs for t in s], dtype=dtype).tofile(f"{prefix}.bin")
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(seqs)))
        f.write(struct.pack("<Q", len(doc_index)))
        f.write(np.asarray(lengths, dtype="<i4").tobytes())
        f.write(pointers.tobytes())
        f.write(doc_index.tobytes())


def random_documents(n_docs: int, vocab: int, seed: int, lo: int = 5, hi: int = 60) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(lo, hi)).tolist() for _ in range(n_docs)]
