"""A rank-aware, deterministic loader of prepared tabular rows (data/tabular.py) whose position is one integer: the
image loader's contract (data/image_loader.py) for click-log recommenders.

Optimizer step k consumes global samples [k·B, (k+1)·B) of the stream; the sample at stream position p is row
order(epoch)[p mod n] of epoch p // n (order.py: a permutation drawn from (seed, epoch), memory-mapped beside the
data). Data-parallel rank r takes its contiguous share of B/D positions and splits them into micro-batches. The
position is the count of consumed samples, so a run resumed at another data-parallel degree continues with exactly
the samples not yet seen. A step's rows are gathered from the memory-mapped arrays in one sorted fancy-indexing read
per array (the page cache serves them in file order), then put back in stream order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from scaletrain.data.order import cached_permutation
from scaletrain.data.position import PositionedLoader
from scaletrain.data.tabular import TabularDataError, open_split, read_tabular_manifest


@dataclass
class TabularBatch:
    dense: torch.Tensor  # (b, D) float32, transformed as the manifest's dense_transform says
    sparse: torch.Tensor  # (b, T) int64 ids; the model takes id % table_rows
    labels: torch.Tensor  # (b,) float32, 0 or 1


class TabularLoader(PositionedLoader[list[TabularBatch]]):
    """This data-parallel rank's micro-batches of one split of a prepared tabular folder, step after step.

    cache_dir: where the epochs' orders are kept (None: data/sources.py's cache_folder of `folder`, i.e. beside the
    data, or the user's cache when the folder is read-only)."""

    trained_only = False  # every label is trained

    def __init__(
        self,
        folder: str | Path,
        split: str,
        global_batch: int,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
        prefetch: int = 0,
        cache_dir: Path | None = None,
    ):
        from scaletrain.data.sources import cache_folder

        super().__init__(global_batch, micro_batch, dp_rank, dp_size, seed, shuffle, prefetch)
        self.folder, self.split = Path(folder), split
        self.manifest = read_tabular_manifest(folder)
        self.dense, self.sparse, self.labels = open_split(folder, split)
        self.num_samples = len(self.labels)
        self.cache_dir = cache_dir if cache_dir is not None else cache_folder(self.folder, None)

    def _order(self, epoch: int) -> np.ndarray:
        return self._cached_order(epoch, lambda: cached_permutation(self.cache_dir, self.num_samples, self.seed, epoch))

    def sample_ids(self, start: int, count: int) -> np.ndarray:
        """Rows (int64) at stream positions [start, start + count), in order."""
        if self.num_samples == 0:
            raise TabularDataError(f"{self.folder}: the {self.split} split has no samples; prepare with more rows "
                                   f"or another --val-share")  # fmt: skip
        epochs, offsets = np.divmod(np.arange(start, start + count, dtype=np.int64), self.num_samples)
        if not self.shuffle:
            return offsets
        rows = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):  # a step spans at most a few epochs
            here = epochs == epoch
            rows[here] = self._order(int(epoch))[offsets[here]]
        return rows

    def _step_at(self, position: int) -> list[TabularBatch]:
        per_rank = self.global_batch // self.dp_size
        rows = self.sample_ids(position + self.dp_rank * per_rank, per_rank)
        by_row = np.argsort(rows, kind="stable")
        wanted = rows[by_row]
        arrays = []
        for source in (self.dense, self.sparse, self.labels):
            gathered = np.empty((per_rank, *source.shape[1:]), dtype=source.dtype)
            gathered[by_row] = source[wanted]  # read in file order, placed back in stream order
            arrays.append(torch.from_numpy(gathered))
        dense, sparse, labels = arrays
        return [TabularBatch(dense[m : m + self.micro_batch], sparse[m : m + self.micro_batch],
                             labels[m : m + self.micro_batch]) for m in range(0, per_rank, self.micro_batch)]  # fmt: skip

    def close(self) -> None:
        """Stop the prefetch thread (pending reads are dropped)."""
        self._ahead.close(wait=True)
