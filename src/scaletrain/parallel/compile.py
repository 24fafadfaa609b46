"""torch.compile per block: each block is compiled once and reused by all of them (same code, same shapes), so
compile time does not grow with depth, and FSDP2 still sees one module per block to shard."""

from __future__ import annotations

from torch import nn

from scaletrain.models.spec import ModelSpec
from scaletrain.parallel.blocks import block_container, block_items


def apply_compile(model: nn.Module, spec: ModelSpec | None = None) -> int:
    """Compile every block (parallel/blocks.py) in place (`nn.Module.compile`, which keeps parameter names).
    Returns the number of blocks compiled."""
    found = block_container(model, spec)
    if found is None:
        raise ValueError("parallel.compile: the model has no container of blocks to compile")
    blocks = block_items(found[1])
    for _, block in blocks:
        block.compile(fullgraph=True)
    return len(blocks)
