"""Loss and perplexity of a model over the trained tokens of a prepared dataset's split, in one process.

The split is read as the trainer reads it (data/loader.py TokenWindows: windows of seq_len tokens with shifted
targets, untrained targets of chat data set to IGNORE_INDEX), every window once, in order; the model is the
family's own (the one trained), the loss the causal-lm task's summed cross-entropy. The loss is its sum divided by
the trained targets (only assistant tokens count on chat data), so a run's validation loss over the same windows
is the same number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from scaletrain.models.spec import ModelSpec


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean cross-entropy per trained token (nats)
    trained_tokens: int  # targets counted
    windows: int  # sequences of seq_len read
    seq_len: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf


def evaluate_prepared(
    weights: dict[str, torch.Tensor],
    spec: ModelSpec,
    folder: Path,
    split: str,
    seq_len: int,
    batch_size: int = 8,
    mask_doc_starts: bool = False,
    device: str = "cpu",
) -> EvalResult:
    """Evaluate `weights` (the family's names) over every window of `split` of the prepared dataset `folder`;
    ValueError (one line naming the flag) when the data cannot feed the model."""
    import numpy as np
    import torch

    from scaletrain.data import TokenWindows
    from scaletrain.data.manifest import DatasetError
    from scaletrain.data.shards import open_prepared
    from scaletrain.models.loss import token_loss_sum

    try:
        manifest, streams = open_prepared(folder)
    except DatasetError as e:
        raise ValueError(f"--data: {e}") from None
    if split not in streams:
        raise ValueError(f"--split: {folder} has no {split!r} split (it has {', '.join(streams)})")
    vocab = spec.vocab_size
    if vocab is not None and manifest.tokenizer.vocab_size > vocab:
        raise ValueError(
            f"--data: its tokenizer's vocabulary ({manifest.tokenizer.vocab_size}) is larger than the model's ({vocab})"
        )
    windows = TokenWindows(streams[split], seq_len, mask_doc_starts)
    if windows.num_samples == 0:
        raise ValueError(f"--split: {split} of {folder} holds fewer than {seq_len + 1} tokens; lower --seq-len")
    model = spec.build("meta")
    model.to_empty(device=device)
    spec.init_buffers(model)
    model.load_state_dict(weights, strict=True)
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    trained = 0
    with torch.no_grad():
        for start in range(0, windows.num_samples, batch_size):
            batch = windows.gather(np.arange(start, min(start + batch_size, windows.num_samples)))
            logits = model(batch.inputs.to(device))
            total += token_loss_sum(logits, batch.targets.to(device)).double().cpu()
            trained += batch.trained_tokens
    if trained == 0:
        raise ValueError(f"--split: {split} of {folder} has no trained tokens (its loss mask is all zero)")
    return EvalResult(float(total) / trained, trained, windows.num_samples, seq_len)
