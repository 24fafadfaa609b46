"""The on-disk format of a prepared dataset: token shards, document boundaries and a manifest.

    DIR/manifest.json                 written last, atomically: a folder without it is not a dataset
    DIR/train/shard-00000.tokens      token ids, little-endian, the manifest's dtype (uint16 or uint32), no header
    DIR/train/shard-00000.docs        int64 little-endian: each document's end offset in the shard (exclusive)
    DIR/train/shard-00000.mask        chat / prompt-completion data only: uint8, 1 per token trained as a target
    DIR/val/shard-00000.tokens ...    the validation split, held out by whole documents

Document d of a shard spans tokens [docs[d-1], docs[d]) (docs[-1] = 0); with EOS on, its last token is the EOS id.
The files of every shard are memory-mapped by the loader, so no rank reads more than the samples it trains on.
The manifest records what made the tokens (tokenizer fingerprint, vocabulary, EOS) and a sha256 per file.
Version 2 adds the optional loss masks (and each shard's count of trained tokens); a dataset without masks is
written as version 1, as before, so older datasets and older readers keep working.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

FORMAT = "scaletrain-tokens"
PLAIN_VERSION = 1  # token shards and document ends
MASKED_VERSION = 2  # ... and a loss mask per shard
VERSION = MASKED_VERSION  # the newest this scaletrain reads
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
DOCS_DTYPE = np.dtype("<i8")
MASK_DTYPE = np.dtype("u1")


class DatasetError(ValueError):
    """A prepared dataset that cannot be used as it is; the message is one line naming the file and the fix."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest little-endian unsigned dtype that holds every id of a vocabulary."""
    if vocab_size <= 1:
        raise DatasetError(f"vocabulary size {vocab_size} is too small")
    if vocab_size <= 2**16:
        return np.dtype("<u2")
    if vocab_size <= 2**32:
        return np.dtype("<u4")
    raise DatasetError(f"vocabulary size {vocab_size} does not fit 32-bit token ids")


@dataclass
class TokenizerInfo:
    kind: str  # "bytes" (the built-in byte tokenizer) or "huggingface" (a tokenizers / transformers tokenizer)
    name: str  # the path or name it was loaded from, for people; the fingerprint is what is compared
    fingerprint: str  # sha256 of the tokenizer's serialised definition
    vocab_size: int
    eos_id: int | None


@dataclass
class Shard:
    tokens: str  # file names relative to the dataset folder
    docs: str
    num_tokens: int
    num_documents: int
    sha256_tokens: str
    sha256_docs: str
    mask: str | None = None  # version 2, chat / prompt-completion data: the loss mask file
    sha256_mask: str | None = None
    num_trained: int | None = None  # tokens whose mask is 1

    def files(self) -> list[tuple[str, int, str]]:
        """(file name, number of items, sha256) of each file of this shard."""
        out = [(self.tokens, self.num_tokens, self.sha256_tokens), (self.docs, self.num_documents, self.sha256_docs)]
        if self.mask is not None:
            out.append((self.mask, self.num_tokens, self.sha256_mask or ""))
        return out


@dataclass
class Split:
    shards: list[Shard] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    @property
    def num_documents(self) -> int:
        return sum(s.num_documents for s in self.shards)

    @property
    def num_trained(self) -> int | None:
        """Tokens trained as targets (masked data), None when the split has no masks (every token is trained)."""
        counts = [s.num_trained for s in self.shards]
        return None if not counts or None in counts else sum(c for c in counts if c is not None)


@dataclass
class DatasetManifest:
    dtype: str  # numpy dtype name of the token files: "uint16" or "uint32"
    tokenizer: TokenizerInfo
    splits: dict[str, Split]
    source: dict = field(default_factory=dict)  # how it was made: inputs, text key, eos, val share (informational)
    created_by: str = ""
    format: str = FORMAT
    version: int = PLAIN_VERSION

    @property
    def masked(self) -> bool:
        return any(s.mask is not None for split in self.splits.values() for s in split.shards)

    def to_json(self) -> str:
        out = asdict(self)
        for name, split in self.splits.items():
            out["splits"][name]["num_tokens"] = split.num_tokens
            out["splits"][name]["num_documents"] = split.num_documents
            for shard in out["splits"][name]["shards"]:
                for key in ("mask", "sha256_mask", "num_trained"):
                    if shard[key] is None:  # a version-1 manifest stays byte for byte what it was
                        del shard[key]
        return json.dumps(out, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> DatasetManifest:
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise DatasetError(f"{where}: not a scaletrain dataset manifest (format {raw.get('format')!r})")
            if int(raw["version"]) > VERSION:
                raise DatasetError(
                    f"{where}: written by a newer scaletrain (format version {raw['version']}, this one reads "
                    f"<= {VERSION}); upgrade scaletrain or prepare the data again"
                )
            splits = {name: Split([Shard(**s) for s in split["shards"]]) for name, split in raw["splits"].items()}
            return cls(
                dtype=str(raw["dtype"]),
                tokenizer=TokenizerInfo(**raw["tokenizer"]),
                splits=splits,
                source=dict(raw.get("source", {})),
                created_by=str(raw.get("created_by", "")),
                version=int(raw["version"]),
            )
        except DatasetError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DatasetError(f"{where}: unreadable manifest ({type(e).__name__}: {e}); prepare the data again") from e


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def is_prepared(folder: str | Path) -> bool:
    return (Path(folder) / MANIFEST).is_file()


def read_manifest(folder: str | Path) -> DatasetManifest:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise DatasetError(
            f"{folder}: no {MANIFEST}; not a prepared dataset (run `scaletrain data prepare ... --out {folder}`)"
        )
    try:
        text = path.read_text()
    except OSError as e:
        raise DatasetError(f"{path}: cannot read ({e.strerror})") from e
    return DatasetManifest.from_json(text, str(path))


def write_manifest(folder: str | Path, manifest: DatasetManifest) -> None:
    """Write the manifest atomically (temporary file, fsync, rename): it is the last thing a prepare writes."""
    path = Path(folder) / MANIFEST
    tmp = path.with_name(f".{MANIFEST}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def check_shard_sizes(folder: str | Path, manifest: DatasetManifest) -> None:
    """Cheap consistency check (file sizes against the manifest's counts), run on every job start."""
    itemsize = np.dtype(manifest.dtype).itemsize
    for split in manifest.splits.values():
        for s in split.shards:
            sizes = (itemsize, DOCS_DTYPE.itemsize, MASK_DTYPE.itemsize)
            for (name, count, _), size in zip(s.files(), sizes):
                p, want = Path(folder) / name, count * size
                if not p.is_file():
                    raise DatasetError(f"{p}: missing; prepare the data again (or rerun the same prepare to finish it)")
                if p.stat().st_size != want:
                    raise DatasetError(
                        f"{p}: {p.stat().st_size} bytes, the manifest says {want}; the file was changed or truncated"
                    )


def verify_shards(folder: str | Path, manifest: DatasetManifest) -> None:
    """Full check: every file's sha256 against the manifest (reads all the data once)."""
    check_shard_sizes(folder, manifest)
    for split in manifest.splits.values():
        for s in split.shards:
            for name, _, want in s.files():
                if sha256_file(Path(folder) / name) != want:
                    raise DatasetError(
                        f"{Path(folder) / name}: checksum does not match the manifest; the shard is corrupt, "
                        "prepare the data again"
                    )
