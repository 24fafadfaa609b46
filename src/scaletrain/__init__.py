"""scaletrain: plan, check, launch, train, recover and monitor multi-GPU PyTorch training."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scaletrain.api import setup
    from scaletrain.train.job import Job

__version__ = "0.1.0"
__all__ = ["Job", "setup"]


def __getattr__(name: str):
    # torch is imported when setup() or Job is first used, not by `import scaletrain` (the CLI starts fast)
    if name == "setup":
        from scaletrain.api import setup

        return setup
    if name == "Job":
        from scaletrain.train.job import Job

        return Job
    raise AttributeError(f"module 'scaletrain' has no attribute {name!r}")
