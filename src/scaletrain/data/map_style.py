"""A rank-aware, resumable loader for a map-style dataset (anything with `__len__` and `__getitem__`), for loops
built on `scaletrain.setup()`.

The same rule as the token loader (data/loader.py): each epoch visits every sample once in an order drawn from
(seed, epoch); optimizer step k consumes global samples [k·B, (k+1)·B) of that order and data-parallel rank r takes
its contiguous share of B/D. The position is one number, the count of consumed samples, so it means the same under
any data-parallel degree: a run resumed on another world size continues with exactly the samples not yet seen.
Batches come from a torch DataLoader (workers, pinning, collate as usual); the position counts what the loop
received, not what workers prefetched.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from scaletrain.data.order import permutation


class StepSampler(Sampler[list[int]]):
    """Batch sampler: this rank's sample indices of every optimizer step from global sample `start` on, forever
    (epochs follow one another, each in its own order)."""

    def __init__(
        self, num_samples: int, global_batch: int, dp_rank: int, dp_size: int, seed: int, shuffle: bool, start: int
    ):
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.per_rank = global_batch // dp_size
        self.dp_rank = dp_rank
        self.seed = seed
        self.shuffle = shuffle
        self.start = start

    def order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        return torch.from_numpy(permutation(self.num_samples, self.seed, epoch))  # the token loader's order rule

    def __iter__(self) -> Iterator[list[int]]:
        pos = self.start
        cache: dict[int, torch.Tensor] = {}
        while True:
            idx = []
            for p in range(pos + self.dp_rank * self.per_rank, pos + (self.dp_rank + 1) * self.per_rank):
                epoch, offset = divmod(p, self.num_samples)
                if epoch not in cache:
                    cache.clear()  # at most the epochs this step spans
                    cache[epoch] = self.order(epoch)
                idx.append(int(cache[epoch][offset]))
            yield idx
            pos += self.global_batch


class ResumableLoader:
    """Iterate for this rank's batch of each optimizer step (global_batch / dp_size samples), without end;
    `state_dict()` / `load_state_dict()` carry the position across a save and a resume on any world size.

        loader = job.loader(dataset, global_batch_size=64)
        extra = job.load(ckpt_dir)
        if extra: loader.load_state_dict(extra["data"])
        for step, batch in zip(range(job.step_count, total_steps), loader): ...
        job.save(ckpt_dir, extra={"data": loader.state_dict()})
    """

    def __init__(
        self,
        dataset: Any,
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        **dataloader_kwargs: Any,
    ):
        if global_batch < 1 or global_batch % dp_size:
            raise ValueError(
                f"global_batch_size: {global_batch} is not a positive multiple of the {dp_size} data-parallel ranks; "
                f"pick a multiple of {dp_size}"
            )
        if len(dataset) < 1:
            raise ValueError("dataset: it is empty (len 0); give the loader at least one sample")
        for key in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"):
            if key in dataloader_kwargs:
                raise ValueError(f"{key}: the loader chooses the samples itself; pass global_batch_size instead")
        self.dataset = dataset
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.shuffle = shuffle
        self.seed = seed
        self.kwargs = dataloader_kwargs
        self.consumed_samples = 0

    @property
    def per_rank_batch(self) -> int:
        return self.global_batch // self.dp_size

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self.consumed_samples // len(self.dataset)

    def __iter__(self) -> Iterator[Any]:
        sampler = StepSampler(
            len(self.dataset), self.global_batch, self.dp_rank, self.dp_size, self.seed, self.shuffle,
            self.consumed_samples,
        )  # fmt: skip
        for batch in DataLoader(self.dataset, batch_sampler=sampler, **self.kwargs):
            self.consumed_samples += self.global_batch
            yield batch

    def state_dict(self) -> dict:
        """The position (global samples consumed) and the order's seed: plain JSON, world-size free."""
        return {"consumed_samples": self.consumed_samples, "seed": self.seed, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])
        self.seed = int(state["seed"])
