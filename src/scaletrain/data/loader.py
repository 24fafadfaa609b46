"""A rank-aware, deterministic loader of fixed-length token windows whose position is one integer.

Sample i is the window tokens[i·S : i·S + S + 1] (inputs and shifted targets). Each epoch visits every sample once in
an order drawn from (seed, epoch). Optimizer step k consumes global samples [k·B, (k+1)·B) of that order; data-parallel
rank r takes its contiguous share of B/D and splits it into micro-batches. Because the position is the count of
consumed samples, not a per-rank cursor, it means the same thing under any data-parallel degree: a run resumed with
another world size continues with exactly the samples not yet seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    inputs: torch.Tensor  # (b, S) int64
    targets: torch.Tensor  # (b, S) int64


class TokenWindows:
    """Fixed-length windows over a token stream."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_samples = (len(tokens) - 1) // seq_len

    def gather(self, indices: torch.Tensor) -> Batch:
        starts = indices * self.seq_len
        offsets = torch.arange(self.seq_len + 1)
        rows = self.tokens[starts[:, None] + offsets[None, :]]
        return Batch(rows[:, :-1].contiguous(), rows[:, 1:].contiguous())


class DistributedLoader:
    def __init__(
        self,
        windows: TokenWindows,
        global_batch: int,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
    ):
        if global_batch % (micro_batch * dp_size):
            raise ValueError(
                f"global batch {global_batch} is not a multiple of micro batch {micro_batch} "
                f"x data-parallel degree {dp_size}"
            )
        self.windows = windows
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.consumed_samples = 0
        self._order_epoch = -1
        self._order = torch.empty(0, dtype=torch.int64)

    @property
    def accumulation_steps(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp_size)

    def _order_for(self, epoch: int) -> torch.Tensor:
        if epoch != self._order_epoch:
            n = self.windows.num_samples
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed * 7_919 + epoch)
                self._order = torch.randperm(n, generator=gen)
            else:
                self._order = torch.arange(n)
            self._order_epoch = epoch
        return self._order

    def _global_indices(self, start: int, count: int) -> torch.Tensor:
        n = self.windows.num_samples
        out = []
        pos = start
        while count > 0:
            epoch, offset = divmod(pos, n)
            take = min(count, n - offset)
            out.append(self._order_for(epoch)[offset : offset + take])
            pos += take
            count -= take
        return torch.cat(out)

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches for the next optimizer step."""
        per_rank = self.global_batch // self.dp_size
        idx = self._global_indices(self.consumed_samples, self.global_batch)
        mine = idx[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        self.consumed_samples += self.global_batch
        return [self.windows.gather(chunk) for chunk in mine.split(self.micro_batch)]

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])
        self.seed = int(state["seed"])
