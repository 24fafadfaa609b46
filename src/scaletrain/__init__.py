"""scaletrain: plan, check, launch, train, recover and monitor multi-GPU PyTorch training."""

from scaletrain.api import setup
from scaletrain.train.job import Job

__version__ = "0.1.0"
__all__ = ["Job", "setup"]
