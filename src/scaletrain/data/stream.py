"""A token stream made of segments (memory-mapped shards, or one array in memory) with document boundaries.

Every source ends up as a TokenStream: a prepared dataset's shards, a Megatron .bin, a flat token file, the stdlib
bytes, synthetic ids. Reading a window copies only that window out of the memory maps (as int64), so a rank holds
the samples it trains on and nothing else; the operating system's page cache, shared by every rank, holds the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Segment:
    """One contiguous run of tokens. `starts`: sorted positions (in units of `scale` per token, so a Megatron
    index's byte pointers can be used as they are) where a document begins, besides position 0, which always
    begins one (a prepared shard's document ends serve as is); None when the source has no documents."""

    tokens: np.ndarray
    starts: np.ndarray | None = None
    scale: int = 1
    mask: np.ndarray | None = None  # uint8 per token, 1 where it is trained as a target (chat data); None: all are


class TokenStream:
    """Segments read as one stream of `num_tokens` ids; `view(lo, hi)` is a sub-stream sharing the same maps."""

    def __init__(self, segments: list[Segment], lo: int = 0, hi: int | None = None):
        self.segments = segments
        sizes = np.array([len(s.tokens) for s in segments], dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.lo = lo
        self.hi = int(self._offsets[-1]) if hi is None else hi
        self.has_documents = bool(segments) and all(s.starts is not None for s in segments)
        self.has_mask = any(s.mask is not None for s in segments)

    @classmethod
    def of(cls, tokens: np.ndarray, starts: np.ndarray | None = None) -> TokenStream:
        return cls([Segment(tokens, starts)])

    @property
    def num_tokens(self) -> int:
        return self.hi - self.lo

    def view(self, lo: int, hi: int) -> TokenStream:
        """Tokens [lo, hi) of this stream."""
        return TokenStream(self.segments, self.lo + lo, self.lo + hi)

    def _pieces(self, lo: int, hi: int):
        """(segment, local start, local stop, global offset of the segment) overlapping absolute [lo, hi)."""
        first = int(np.searchsorted(self._offsets, lo, side="right")) - 1
        for k in range(max(first, 0), len(self.segments)):
            off = int(self._offsets[k])
            if off >= hi:
                break
            end = int(self._offsets[k + 1])
            if end > lo:
                yield self.segments[k], max(lo, off) - off, min(hi, end) - off, off

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of this stream as int64 (a copy of just those tokens)."""
        lo, hi = self.lo + start, self.lo + stop
        if start < 0 or hi > self.hi:
            raise IndexError(f"tokens [{start}, {stop}) outside a stream of {self.num_tokens}")
        parts = [np.asarray(seg.tokens[a:b], dtype=np.int64) for seg, a, b, _ in self._pieces(lo, hi)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def read_mask(self, start: int, stop: int) -> np.ndarray:
        """The loss mask of tokens [start, stop) as bool (True: trained); all True where a segment has none."""
        lo, hi = self.lo + start, self.lo + stop
        if start < 0 or hi > self.hi:
            raise IndexError(f"tokens [{start}, {stop}) outside a stream of {self.num_tokens}")
        parts = [
            np.ones(b - a, dtype=bool) if seg.mask is None else np.asarray(seg.mask[a:b]) != 0
            for seg, a, b, _ in self._pieces(lo, hi)
        ]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def document_starts(self, start: int, stop: int) -> np.ndarray:
        """Positions p in [start, stop) of this stream where a new document begins (int64, ascending)."""
        lo, hi = self.lo + start, self.lo + stop
        out = []
        for seg, a, b, off in self._pieces(lo, hi):
            if seg.starts is None:
                continue
            if a == 0:
                out.append(np.array([off - self.lo], dtype=np.int64))
            i = int(np.searchsorted(seg.starts, a * seg.scale, side="left"))
            j = int(np.searchsorted(seg.starts, b * seg.scale, side="left"))
            out.append(np.asarray(seg.starts[i:j], dtype=np.int64) // seg.scale + off - self.lo)
        return np.unique(np.concatenate(out)) if out else np.empty(0, dtype=np.int64)
