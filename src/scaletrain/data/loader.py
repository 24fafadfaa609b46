"""A rank-aware, deterministic loader of fixed-length token windows whose position is one integer.

Sample i of a dataset is the window tokens[i·S : i·S + S + 1] (inputs and shifted targets) of its token stream:
documents are packed back to back, each ending in the EOS its preparation wrote, and a window may span several.
With mask_doc_starts, a target that is the first token of a new document is set to IGNORE_INDEX, so the model is
not trained to guess a document's start from the previous one. A stream with a loss mask (chat and
prompt-completion data) sets every target the mask marks untrained (system and user turns, template scaffolding)
to IGNORE_INDEX; the samples read and their order are the same either way, so resuming is unchanged. Under
data.packing = "pad" or "document" a sample is instead a row of whole documents (packing.py), read the same way.

Each epoch of a dataset visits every sample once in an order drawn from (seed, epoch), memory-mapped from a file
built once beside the data (order.py). Several datasets are interleaved by weight (mix.py). Optimizer step k
consumes global samples [k·B, (k+1)·B); data-parallel rank r takes its contiguous share of B/D, reads only those
windows, and splits them into micro-batches. Because the position is the count of consumed samples, not a per-rank
cursor, it means the same thing under any data-parallel degree: a run resumed with another world size continues
with exactly the samples not yet seen. With prefetch > 0 a background thread reads the next steps' windows while
the current step computes (reading is a pure function of the position, so prefetched steps never change what a
step gets).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from scaletrain.config.schema import DataConfig
from scaletrain.data.mix import MixSchedule
from scaletrain.data.order import cached_permutation
from scaletrain.data.packing import PackedDocuments, Rows
from scaletrain.data.position import PositionedLoader
from scaletrain.data.sources import open_datasets
from scaletrain.data.stream import TokenStream
from scaletrain.models.loss import IGNORE_INDEX


@dataclass
class Batch:
    inputs: torch.Tensor  # (b, S) int64
    targets: torch.Tensor  # (b, S) int64
    # rows packing several documents (data.packing="document"): each token's position inside its document and the
    # document's index in its row, (b, S) int64; None for a stream window or one document per row
    positions: torch.Tensor | None = None
    documents: torch.Tensor | None = None
    # the data decides what is trained (a loss mask, or padding of whole-document rows): a loss normalised per
    # trained token divides by `trained_tokens`, not by every target position
    trained_only: bool = False

    @property
    def trained_tokens(self) -> int:
        """Targets the loss counts (not IGNORE_INDEX): what a loss normalised per trained token divides by."""
        return int((self.targets != IGNORE_INDEX).sum())


class TokenWindows:
    """Fixed-length windows over a token stream (a TokenStream, or a 1-D array/tensor of ids held in memory).
    cache_dir: where this dataset's sample orders are kept (None: in memory)."""

    def __init__(
        self,
        tokens: TokenStream | np.ndarray | torch.Tensor,
        seq_len: int,
        mask_doc_starts: bool = False,
        cache_dir: Path | None = None,
        name: str = "data",
    ):
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.numpy()
        self.stream = tokens if isinstance(tokens, TokenStream) else TokenStream.of(np.asarray(tokens))
        self.seq_len = seq_len
        self.mask_doc_starts = mask_doc_starts
        self.cache_dir = cache_dir
        self.name = name
        self.num_samples = max(0, (self.stream.num_tokens - 1) // seq_len)

    def rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets) of the given samples, each (len(indices), S) int64."""
        s = self.seq_len
        rows = np.stack([self.stream.read(i * s, i * s + s + 1) for i in map(int, indices)])
        targets = rows[:, 1:].copy()
        if self.stream.has_mask:
            trained = np.stack([self.stream.read_mask(i * s + 1, i * s + s + 1) for i in map(int, indices)])
            targets[~trained] = IGNORE_INDEX
        if self.mask_doc_starts:
            for r, i in enumerate(map(int, indices)):
                starts = self.stream.document_starts(i * s + 1, i * s + s + 1)
                targets[r, starts - (i * s + 1)] = IGNORE_INDEX
        return rows[:, :-1], targets

    def read(self, indices: np.ndarray) -> Rows:
        inputs, targets = self.rows(indices)
        return Rows(np.ascontiguousarray(inputs), targets)

    def order(self, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
        """The sample order of an epoch, drawn from (seed, epoch)."""
        if not shuffle:
            return np.arange(self.num_samples, dtype=np.int64)
        return cached_permutation(self.cache_dir, self.num_samples, seed, epoch)

    def gather(self, indices: torch.Tensor | np.ndarray) -> Batch:
        return _batch(self.read(np.asarray(indices)), self.stream.has_mask)


Dataset = TokenWindows | PackedDocuments  # what the loader reads samples from


def _batch(rows: Rows, trained_only: bool) -> Batch:
    def tensor(a: np.ndarray | None) -> torch.Tensor | None:
        return None if a is None else torch.from_numpy(a)

    return Batch(torch.from_numpy(rows.inputs), torch.from_numpy(rows.targets), tensor(rows.positions),
                 tensor(rows.documents), trained_only)  # fmt: skip


def trained_only(dataset: Dataset) -> bool:
    """Whether the data decides which targets are trained: a loss mask, or rows of whole documents (padded)."""
    return dataset.stream.has_mask or isinstance(dataset, PackedDocuments)


class DistributedLoader(PositionedLoader[list[Batch]]):
    """This data-parallel rank's micro-batches, step after step, from one dataset or several mixed by `weights`."""

    def __init__(
        self,
        windows: Dataset | list[Dataset],
        global_batch: int,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
        weights: list[float] | None = None,
        prefetch: int = 0,
    ):
        super().__init__(global_batch, micro_batch, dp_rank, dp_size, seed, shuffle, prefetch)
        self.datasets: list[Dataset] = windows if isinstance(windows, list) else [windows]
        self.windows = self.datasets[0]
        self.trained_only = any(trained_only(d) for d in self.datasets)  # every batch of the loader counts alike
        self.mix = MixSchedule(weights or [1.0] * len(self.datasets))
        if len(self.mix.quotas) != len(self.datasets):
            raise ValueError(f"{len(self.datasets)} datasets but {len(self.mix.quotas)} weights")

    def _order(self, k: int, epoch: int) -> np.ndarray:
        return self._cached_order(
            (k, epoch), lambda: self.datasets[k].order(self.seed, epoch, self.shuffle), keep=2 * len(self.datasets)
        )

    def sample_ids(self, start: int, count: int) -> list[tuple[int, int]]:
        """(dataset, sample) of global samples [start, start + count), in order."""
        which, local = self.mix.locate(np.arange(start, start + count, dtype=np.int64))
        out = []
        for k, j in zip(which.tolist(), local.tolist()):
            n = self.datasets[k].num_samples
            epoch, offset = divmod(j, n)
            out.append((k, int(self._order(k, epoch)[offset])))
        return out

    def _step_at(self, position: int) -> list[Batch]:
        per_rank = self.global_batch // self.dp_size
        mine = self.sample_ids(position + self.dp_rank * per_rank, per_rank)
        batches = []
        for m in range(0, per_rank, self.micro_batch):
            chunk = mine[m : m + self.micro_batch]
            shape = (len(chunk), self.windows.seq_len)
            per_document = isinstance(self.windows, PackedDocuments) and self.windows.per_document
            out = Rows(*(np.empty(shape, dtype=np.int64) for _ in range(4 if per_document else 2)))
            for k in {k for k, _ in chunk}:
                rows = [r for r, (kk, _) in enumerate(chunk) if kk == k]
                got = self.datasets[k].read(np.array([chunk[r][1] for r in rows]))
                for whole, part in zip(out, got):
                    if whole is not None and part is not None:
                        whole[rows] = part
            batches.append(_batch(out, self.trained_only))
        return batches

    def close(self) -> None:
        """Stop the prefetch thread (pending reads are dropped)."""
        self._ahead.close(wait=False)


def samples_of(stream: TokenStream, cfg: DataConfig, cache_dir: Path | None, name: str) -> Dataset:
    """The samples of one dataset's stream under data.packing: stream windows ("concat") or whole-document rows."""
    if cfg.packing == "concat":
        return TokenWindows(stream, cfg.seq_len, cfg.mask_doc_starts, cache_dir, name)
    return PackedDocuments(stream, cfg.seq_len, cfg.packing, cache_dir, name)


def build_loaders(
    cfg: DataConfig, vocab_size: int, seed: int, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int
) -> tuple[DistributedLoader, DistributedLoader]:
    """(training loader, validation loader) of one data-parallel rank for the job's data section. Ids are not
    checked here: preflight (checks.py) did that before any rank started."""
    datasets = open_datasets(cfg, vocab_size, seed)
    weights = [entry.weight for _, entry in cfg.datasets()] if cfg.mix else None
    train = [samples_of(d.train, cfg, d.cache_dir, d.name) for d in datasets]
    val = [samples_of(d.val, cfg, None, d.name) for d in datasets]
    return (
        DistributedLoader(
            train, global_batch, micro_batch, dp_rank, dp_size, seed, weights=weights, prefetch=cfg.prefetch
        ),
        DistributedLoader(val, global_batch, micro_batch, dp_rank, dp_size, seed, shuffle=False, weights=weights),
    )
