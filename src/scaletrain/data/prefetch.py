"""Steps read ahead of the training loop in one background thread, keyed by their stream position.

A step's batches are a pure function of its position (data/loader.py, data/image_loader.py), so a step read ahead is
the step the loop would have read; a read made for a position the loop no longer asks for (a resume, an evaluation
restart) is dropped.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

Step = TypeVar("Step")


class StepPrefetch(Generic[Step]):
    """`take(position)` returns `step_at(position)`, read ahead by up to `depth` steps (`stride` samples apart) in
    one thread while the caller computes; depth 0 reads in the caller's thread."""

    def __init__(self, step_at: Callable[[int], Step], stride: int, depth: int):
        self._step_at = step_at
        self._stride = stride
        self._depth = depth
        self._pending: deque[tuple[int, Future[Step]]] = deque()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="scaletrain-data") if depth > 0 else None

    def take(self, position: int) -> Step:
        """The step at `position`; the reads of the next `depth` steps are started before it returns."""
        step = None
        while self._pending:
            at, future = self._pending.popleft()
            if at == position:
                step = future.result()
                break
            future.cancel()  # the position moved (a resume or an evaluation restart): that read is not wanted
        if step is None:
            self._pending.clear()
            step = self._step_at(position)
        if self._pool is not None:
            ahead = self._pending[-1][0] if self._pending else position
            while len(self._pending) < self._depth:
                ahead += self._stride
                self._pending.append((ahead, self._pool.submit(self._step_at, ahead)))
        return step

    def drop(self) -> None:
        """Cancel the reads ahead (the position or the seed changed)."""
        for _, future in self._pending:
            future.cancel()
        self._pending.clear()

    def close(self, wait: bool) -> None:
        """Drop the reads ahead and stop the thread; `wait`: until a read in progress finishes."""
        self.drop()
        if self._pool is not None:
            self._pool.shutdown(wait=wait, cancel_futures=True)
