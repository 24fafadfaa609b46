"""Which modules are a model's blocks: the one rule FSDP, activation checkpointing, compile and the automatic TP
plan share. A model with a spec says so itself (ModelSpec.blocks); any other model (`scaletrain.setup()`) is read
by structure: its largest ModuleList / ModuleDict."""

from __future__ import annotations

from torch import nn

from scaletrain.models.spec import ModelSpec


def block_container(
    model: nn.Module, spec: ModelSpec | None = None
) -> tuple[str, nn.ModuleDict | nn.ModuleList] | None:
    """(path, container) of the model's repeated blocks, or None when it has none."""
    if spec is not None:
        container = spec.blocks(model)
        path = next((n for n, m in model.named_modules() if m is container), "")
        return path, container
    best: tuple[str, nn.ModuleDict | nn.ModuleList] | None = None
    for path, m in model.named_modules():
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m) and (best is None or len(m) > len(best[1])):
            best = (path, m)
    return best


def block_items(container: nn.ModuleDict | nn.ModuleList) -> list[tuple[str, nn.Module]]:
    """(key, block) in order; keys as str (ModuleDict keys, or list positions)."""
    if isinstance(container, nn.ModuleDict):
        return list(container.items())
    return [(str(i), b) for i, b in enumerate(container)]


def set_block(container: nn.ModuleDict | nn.ModuleList, key: str, block: nn.Module) -> None:
    if isinstance(container, nn.ModuleDict):
        container[key] = block
    else:
        container[int(key)] = block
