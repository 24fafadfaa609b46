"""The training loop and the per-step mechanics it shares with `scaletrain.setup()`.

The names below are imported on first use: the launching command names its ranks' entry points (worker.py,
inprocess.py) without importing the trainer, which only the ranks, forked from a server that imported it, run."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scaletrain.train.job import Job, make_scaler, rebind_optimizer
    from scaletrain.train.loop import train
    from scaletrain.train.trainer import Trainer

_HOMES = {"Job": "job", "make_scaler": "job", "rebind_optimizer": "job", "train": "loop", "Trainer": "trainer"}

__all__ = ["Job", "Trainer", "make_scaler", "rebind_optimizer", "train"]


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'scaletrain.train' has no attribute {name!r}")
    return getattr(importlib.import_module(f"scaletrain.train.{home}"), name)
