"""The training loss, one function for every path (plain, accumulation, tensor-parallel loss-parallel, pipeline
last stage): summed token cross-entropy with logits in fp32, targets equal to IGNORE_INDEX not counted."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # the convention of torch's cross_entropy and of Hugging Face labels


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of cross-entropy(logits (B, S, V), targets (B, S)); a vocabulary-sharded DTensor of logits
    works under torch's loss_parallel() context."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)
