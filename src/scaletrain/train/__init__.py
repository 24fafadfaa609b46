"""The training loop and the per-step mechanics it shares with `scaletrain.setup()`."""

from scaletrain.train.job import Job, make_scaler, rebind_optimizer
from scaletrain.train.loop import train
from scaletrain.train.preflight import ResolvedJob, resolve_job
from scaletrain.train.trainer import Trainer

__all__ = ["Job", "ResolvedJob", "Trainer", "make_scaler", "rebind_optimizer", "resolve_job", "train"]
