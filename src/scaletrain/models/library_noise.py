"""Known-harmless messages libraries log while they are imported, kept off the terminal so that a user's one-line
error (or the first progress line) is the first thing they read:
- torchao logs "Failed to load ...so" for each CUDA-only kernel library it cannot load on a host without them
  (torchao 0.18; fp8 training does not use those kernels, and CPUs emulate fp8);
- torch's pytree warns that torchao registers Enum subclasses it no longer needs to (torch 2.13, torchao 0.18);
- diffusers warns "Unable to import `torchao` Tensor objects" when torchao 0.18 lacks classes of older releases it
  allow-lists for loading torchao-quantized checkpoints (diffusers 0.42; the diffusion family loads none).
transformers imports torchao through its quantizers as soon as a model class is looked up, so both reach every HF
model's job, fp8 or not."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

NOISY_LOGGERS = ("torchao", "torch.utils._pytree", "diffusers.quantizers")


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Raise NOISY_LOGGERS to ERROR for the duration (errors still show), then restore their levels."""
    loggers = [logging.getLogger(name) for name in NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
