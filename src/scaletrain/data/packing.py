"""Samples made of whole documents, for data.packing = "pad" and "document" (data.packing = "concat", the default,
reads fixed windows of the token stream instead: loader.TokenWindows).

A document is cut into pieces of at most seq_len + 1 tokens (a piece gives seq_len input/target pairs; a longer
document continues in the next piece, which starts where the previous one's targets ended). Pieces are then laid
out one of two ways:

- pad: one piece per row, padded to seq_len with id 0 whose targets are IGNORE_INDEX;
- document: consecutive pieces packed greedily into rows of seq_len (a pack closes when the next piece no longer
  fits; its tail is padded as above). Every token carries its position inside its piece (restarting at 0) and the
  index of its piece in the row (the padded tail is one more), so the model attends only within a piece
  (block-causal) and rotates by the piece's own positions: a packed row computes what its pieces would alone.

Both layouts visit the pieces in the same order: epoch e draws a permutation of the packs from (seed, e), and the
pad layout walks the pieces of those packs in turn. So switching between "pad" and "document" changes how the same
pieces are laid out, never which pieces a run trains on, and a step of G packed rows holds the same pieces as the
matching steps of the pad layout. Targets the stream's loss mask marks untrained (chat data) are IGNORE_INDEX as
in the windows; the loss counts trained targets only (the causal-lm task's count).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

from scaletrain.data.order import cached_permutation
from scaletrain.data.stream import TokenStream
from scaletrain.models.loss import IGNORE_INDEX

PACKINGS = ("concat", "pad", "document")


class Rows(NamedTuple):
    """Samples as (n, S) int64 arrays: positions and documents (each token's position inside its document and the
    document's index in the row) only where a row packs several documents, else None."""

    inputs: np.ndarray
    targets: np.ndarray
    positions: np.ndarray | None = None
    documents: np.ndarray | None = None


PAD_ID = 0  # what fills a row's tail; never a target (IGNORE_INDEX) and, in "document", never attended to by text


def document_pieces(stream: TokenStream, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends): token ranges [start, end) of the stream's pieces, each 2..seq_len+1 tokens of one
    document, in stream order (int64)."""
    n = stream.num_tokens
    doc_starts = stream.document_starts(0, n)
    if len(doc_starts) == 0 or doc_starts[0] != 0:
        doc_starts = np.concatenate([[0], doc_starts]).astype(np.int64)
    doc_ends = np.append(doc_starts[1:], n)
    lengths = doc_ends - doc_starts
    chunks = np.where(lengths >= 2, -(-(lengths - 1) // seq_len), 0)  # ceil((len - 1) / S) pieces per document
    first = np.repeat(doc_starts, chunks)
    within = np.arange(int(chunks.sum()), dtype=np.int64) - np.repeat(np.cumsum(chunks) - chunks, chunks)
    starts = first + within * seq_len
    ends = np.minimum(starts + seq_len + 1, np.repeat(doc_ends, chunks))
    return starts.astype(np.int64), ends.astype(np.int64)


def greedy_packs(slots: np.ndarray, seq_len: int) -> np.ndarray:
    """First piece of every pack and one past the last (int64, length packs + 1): consecutive pieces of `slots`
    input positions each (<= seq_len) go into one pack while their sum fits seq_len."""
    bounds = [0]
    used = 0
    for i, s in enumerate(slots.tolist()):
        if used + s > seq_len:
            bounds.append(i)
            used = 0
        used += s
    if len(slots):
        bounds.append(len(slots))
    return np.asarray(bounds, dtype=np.int64)


class PackedDocuments:
    """Rows of whole-document pieces of a token stream (the loader's dataset interface, as loader.TokenWindows):
    `num_samples` rows, `rows(indices)`, `order(seed, epoch)`. mode: "pad" or "document".
    cache_dir: where the pack order permutations are kept (None: in memory)."""

    def __init__(self, stream: TokenStream, seq_len: int, mode: str, cache_dir: Path | None = None, name: str = "data"):
        if mode not in ("pad", "document"):
            raise ValueError(f"data.packing: {mode!r} is not pad or document")
        self.stream = stream
        self.seq_len = seq_len
        self.mode = mode
        self.cache_dir = cache_dir
        self.name = name
        self.starts, self.ends = document_pieces(stream, seq_len)
        self.packs = greedy_packs(self.ends - self.starts - 1, seq_len)
        self.num_packs = len(self.packs) - 1
        self.num_samples = len(self.starts) if mode == "pad" else self.num_packs

    # whether rows carry positions and document ids (the model must attend per document)
    @property
    def per_document(self) -> bool:
        return self.mode == "document"

    def order(self, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
        """The sample order of an epoch: packs in a permutation drawn from (seed, epoch); under "pad" the pieces
        of those packs in turn."""
        packs = (
            cached_permutation(self.cache_dir, self.num_packs, seed, epoch)
            if shuffle
            else np.arange(self.num_packs, dtype=np.int64)
        )
        if self.mode == "document":
            return packs
        first, count = self.packs[packs], np.diff(self.packs)[packs]
        offsets = np.cumsum(count) - count
        return np.repeat(first - offsets, count) + np.arange(int(count.sum()), dtype=np.int64)

    def _piece(self, p: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, trained) of piece p: its tokens and, per target (tokens[1:]), whether the loss counts it."""
        lo, hi = int(self.starts[p]), int(self.ends[p])
        tokens = self.stream.read(lo, hi)
        trained = self.stream.read_mask(lo + 1, hi) if self.stream.has_mask else np.ones(hi - lo - 1, dtype=bool)
        return tokens, trained

    def rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets) of the given samples, each (len(indices), S) int64."""
        return self.read(indices)[:2]

    def read(self, indices: np.ndarray) -> Rows:
        """The given samples; positions and documents are None under "pad" (a row holds one piece from position
        0: plain causal attention)."""
        s = self.seq_len
        n = len(indices)
        inputs = np.full((n, s), PAD_ID, dtype=np.int64)
        targets = np.full((n, s), IGNORE_INDEX, dtype=np.int64)
        positions = np.zeros((n, s), dtype=np.int64) if self.per_document else None
        documents = np.zeros((n, s), dtype=np.int64) if self.per_document else None
        for r, i in enumerate(map(int, indices)):
            pieces = range(i, i + 1) if self.mode == "pad" else range(int(self.packs[i]), int(self.packs[i + 1]))
            at = 0
            for d, p in enumerate(pieces):
                tokens, trained = self._piece(p)
                k = len(tokens) - 1
                inputs[r, at : at + k] = tokens[:-1]
                targets[r, at : at + k] = np.where(trained, tokens[1:], IGNORE_INDEX)
                if positions is not None and documents is not None:
                    positions[r, at : at + k] = np.arange(k)
                    documents[r, at : at + k] = d
                at += k
            if positions is not None and documents is not None and at < s:  # the tail: a document of its own
                positions[r, at:] = np.arange(s - at)
                documents[r, at:] = len(pieces)
        return Rows(inputs, targets, positions, documents)
