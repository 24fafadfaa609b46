"""The training loop and the per-step mechanics it shares with `scaletrain.setup()`."""

from scaletrain.train.job import Job, make_scaler, rebind_optimizer
from scaletrain.train.loop import train
from scaletrain.train.trainer import Trainer

__all__ = ["Job", "Trainer", "make_scaler", "rebind_optimizer", "train"]
