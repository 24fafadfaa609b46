"""A rank-aware, deterministic loader of decoded images whose position is one integer: the token loader's contract
(data/loader.py) for image classification.

Optimizer step k consumes global samples [k·B, (k+1)·B) of the stream; the sample at stream position p is sample
order(epoch)[p mod n] of epoch p // n (order.py: a permutation drawn from (seed, epoch), memory-mapped beside the
data). Data-parallel rank r takes its contiguous share of B/D positions and splits them into micro-batches. The
position is the count of consumed samples, so a run resumed at another data-parallel degree continues with exactly
the samples not yet seen, and the augmentation of each sample is drawn from (seed, its position): a resumed run sees
the same pixels. `workers` threads decode a step's images; with prefetch > 0 the next steps are decoded while the
current one computes (decoding is a pure function of the position, so prefetching never changes a step).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from scaletrain.data.images import ImageShards, Pixels
from scaletrain.data.position import PositionedLoader


@dataclass
class ImageBatch:
    pixels: torch.Tensor  # (b, C, H, W) float32, normalised
    labels: torch.Tensor  # (b,) int64


class ImageLoader(PositionedLoader[list[ImageBatch]]):
    """This data-parallel rank's micro-batches of decoded images, step after step."""

    trained_only = False  # every label is trained

    def __init__(
        self,
        shards: ImageShards,
        pixels: Pixels,
        global_batch: int,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
        workers: int = 2,
        prefetch: int = 0,
    ):
        super().__init__(global_batch, micro_batch, dp_rank, dp_size, seed, shuffle, prefetch)
        self.shards, self.pixels = shards, pixels
        self._decoders = ThreadPoolExecutor(max(1, workers), thread_name_prefix="scaletrain-decode")

    def _order(self, epoch: int) -> np.ndarray:
        return self._cached_order(epoch, lambda: self.shards.order(self.seed, epoch, self.shuffle))

    def sample_ids(self, start: int, count: int) -> list[int]:
        """Dataset samples at stream positions [start, start + count), in order."""
        n = self.shards.num_samples
        out = []
        for position in range(start, start + count):
            epoch, offset = divmod(position, n)
            out.append(int(self._order(epoch)[offset]))
        return out

    def _decode(self, position: int, sample: int) -> tuple[torch.Tensor, int]:
        data, label = self.shards.read(sample)
        return self.pixels.decode(data, self.seed, position), label

    def _step_at(self, position: int) -> list[ImageBatch]:
        per_rank = self.global_batch // self.dp_size
        start = position + self.dp_rank * per_rank
        samples = self.sample_ids(start, per_rank)
        decoded = list(self._decoders.map(self._decode, range(start, start + per_rank), samples))
        batches = []
        for m in range(0, per_rank, self.micro_batch):
            chunk = decoded[m : m + self.micro_batch]
            pixels = torch.stack([p for p, _ in chunk])
            batches.append(ImageBatch(pixels, torch.tensor([label for _, label in chunk], dtype=torch.int64)))
        return batches

    def close(self) -> None:
        """Stop the prefetch and decoding threads (pending reads are dropped)."""
        self._ahead.close(wait=True)
        self._decoders.shutdown(wait=True, cancel_futures=True)
        self.shards.close()
