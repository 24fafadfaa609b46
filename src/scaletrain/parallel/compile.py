"""torch.compile per transformer block: each block is compiled once and reused by all of them (same code, same
shapes), so compile time does not grow with depth, and FSDP2 still sees one module per block to shard."""

from __future__ import annotations

from torch import nn


def apply_compile(model: nn.Module) -> int:
    """Compile every block of the model's `layers` container in place (`nn.Module.compile`, which keeps parameter
    names). Returns the number of blocks compiled."""
    container = getattr(model, "layers", None)
    if not isinstance(container, (nn.ModuleDict, nn.ModuleList)):
        raise ValueError("parallel.compile: the model has no `layers` container of blocks to compile")
    blocks = list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)
    for block in blocks:
        block.compile(fullgraph=True)
    return len(blocks)
