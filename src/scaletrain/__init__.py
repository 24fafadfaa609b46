"""scaletrain: plan, check, launch, train, recover and monitor multi-GPU PyTorch training."""

__version__ = "0.1.0"
