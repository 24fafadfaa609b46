"""Packed rows (data.packing = "document") for transformers models: the trainer calls every model's forward with
`positions=` and `documents=` ((B, S) int64); a transformers model takes `position_ids` instead and finds the
documents itself. transformers 5 builds its attention masks in masking_utils.create_causal_mask, which, given
position_ids and no attention_mask or cache (training with use_cache off), detects packed sequences where the
position does not step by one (find_packed_sequence_indices) and masks per sequence for every attention kernel
(eager, SDPA, flex; flash attention through the same position_ids). Every document starts at position 0 (the
padded tail of a row too), so that detection finds exactly the row's documents; the document ids are then
redundant and dropped.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def _packed_to_position_ids(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """Forward pre-hook: positions= -> position_ids=, documents= dropped (see the module docstring)."""
    if "positions" in kwargs or "documents" in kwargs:
        kwargs = dict(kwargs)
        positions = kwargs.pop("positions", None)
        kwargs.pop("documents", None)
        if positions is not None:
            kwargs["position_ids"] = positions
    return args, kwargs


def take_packed_rows(model: nn.Module) -> None:
    """Let `model` (a transformers model, or a pipeline stage cut from it: the hook is copied with it) take the
    trainer's positions= / documents= keywords."""
    model.register_forward_pre_hook(_packed_to_position_ids, with_kwargs=True)
