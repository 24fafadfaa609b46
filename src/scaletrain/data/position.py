"""What every loader of scaletrain shares (token streams: data/loader.py, images: data/image_loader.py, tabular rows:
data/tabular_loader.py): its position is one integer, the count of samples consumed, so a step's batches are a pure
function of it (read ahead by StepPrefetch, resumed at any data-parallel degree); an epoch's sample order is built
once and kept while recent. A loader subclass reads one step's micro-batches of this rank in `_step_at`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

import numpy as np

from scaletrain.data.prefetch import StepPrefetch

Step = TypeVar("Step")


class PositionedLoader(Generic[Step]):
    """`next_step()` gives this data-parallel rank's micro-batches of the next optimizer step (`micro_batch` samples
    each, `global_batch` samples over all `dp_size` ranks); `state_dict()` / `load_state_dict()` its position."""

    def __init__(
        self, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int, seed: int, shuffle: bool, prefetch: int
    ):
        if global_batch % (micro_batch * dp_size):
            raise ValueError(f"global batch {global_batch} is not a multiple of micro batch {micro_batch} x "
                             f"data-parallel degree {dp_size}")  # fmt: skip
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.consumed_samples = 0
        self.prefetch = prefetch
        self._orders: dict[Any, np.ndarray] = {}
        self._lock = threading.Lock()
        self._ahead: StepPrefetch[Step] = StepPrefetch(self._step_at, global_batch, prefetch)

    @property
    def accumulation_steps(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp_size)

    def _cached_order(self, key: Hashable, build: Callable[[], np.ndarray], keep: int = 2) -> np.ndarray:
        """The order `build()` makes for `key` (an epoch, or a dataset's epoch), built once and kept while at most
        `keep` others are (older epochs are dropped)."""
        with self._lock:  # the prefetch thread and the step may both ask
            order = self._orders.get(key)
            if order is None:
                if len(self._orders) > keep:  # keep only recent epochs mapped
                    self._orders.clear()
                order = self._orders[key] = build()
            return order

    def _step_at(self, position: int) -> Step:
        """This rank's micro-batches of the step starting at stream position `position`."""
        raise NotImplementedError

    def next_step(self) -> Step:
        """This rank's micro-batches for the next optimizer step."""
        batches = self._ahead.take(self.consumed_samples)
        self.consumed_samples += self.global_batch
        return batches

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])
        self.seed = int(state["seed"])
        self._orders.clear()
        self._ahead.drop()
