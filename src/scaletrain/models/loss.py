"""The training loss, one function for every path (plain, accumulation, tensor-parallel loss-parallel, pipeline
last stage): summed token cross-entropy with logits in fp32, targets equal to IGNORE_INDEX not counted."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from scaletrain.models.spec import LOSS_CHUNK_TOKENS

IGNORE_INDEX = -100  # the convention of torch's cross_entropy and of Hugging Face labels


def _loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, reduction="sum", ignore_index=IGNORE_INDEX)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, chunked: bool = True) -> torch.Tensor:
    """Sum over tokens of cross-entropy(logits (B, S, V), targets (B, S)); a vocabulary-sharded DTensor of logits
    works under torch's loss_parallel() context.

    chunked (plain tensors): LOSS_CHUNK_TOKENS tokens at a time under activation checkpointing, so backward keeps
    only the logits in their own dtype (no fp32 copy, no fp32 log-softmax output per token) and recomputes one
    chunk's fp32 log-softmax at a time."""
    flat, tgt = logits.flatten(0, 1), targets.flatten()
    if not chunked or hasattr(logits, "device_mesh"):  # DTensor (loss parallel): its sharded kernel as is
        return _loss_sum(flat, tgt)
    from torch.utils.checkpoint import checkpoint

    parts = [
        checkpoint(_loss_sum, x, t, use_reentrant=False)
        for x, t in zip(flat.split(LOSS_CHUNK_TOKENS), tgt.split(LOSS_CHUNK_TOKENS), strict=True)
    ]
    return torch.stack(parts).sum() if len(parts) > 1 else parts[0]
