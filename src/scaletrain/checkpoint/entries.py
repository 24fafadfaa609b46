"""The tensors a DCP checkpoint holds, listed from its metadata and read a chosen few at a time, on one process:
what export and the adapter export read (no process group, no model built)."""

from __future__ import annotations

import re
from pathlib import Path

import torch


def natural_order(name: str) -> list:
    """Sort key putting layer 2 before layer 10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def saved_entries(ckpt: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """{name: (full shape, dtype)} of every model tensor DCP's metadata lists (saved as `model.<name>`), in
    natural name order; nothing is read but the metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from scaletrain.checkpoint.safe_load import METADATA_FILE, read_dcp_metadata

    with open(ckpt / METADATA_FILE, "rb") as f:
        meta = read_dcp_metadata(f, f"{ckpt.name}/{METADATA_FILE}")
    found = {
        key.removeprefix("model."): (m.size, m.properties.dtype)
        for key, m in meta.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    return {name: found[name] for name in sorted(found, key=natural_order)}


def read_entries(ckpt: Path, entries: dict[str, tuple[torch.Size, torch.dtype]]) -> dict[str, torch.Tensor]:
    """Only these model tensors of the checkpoint, whole (DCP reads each from its shards; the others stay on disk)."""
    from scaletrain.checkpoint.safe_load import load_dcp

    state = {"model": {name: torch.empty(size, dtype=dtype) for name, (size, dtype) in entries.items()}}
    load_dcp(state, ckpt, no_dist=True)
    return state["model"]
