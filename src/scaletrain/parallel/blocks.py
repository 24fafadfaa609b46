"""Which modules are a model's blocks: the one rule FSDP, activation checkpointing, compile and the automatic TP
plan share. A model with a spec says so itself (ModelSpec.blocks); any other model (`scaletrain.setup()`) is read
by structure: its largest ModuleList / ModuleDict. `fsdp_units` turns that (or the user's choice) into FSDP units."""

from __future__ import annotations

from collections.abc import Callable

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


# What `scaletrain.setup(shard=...)` accepts: block classes, or a predicate over (qualified name, module).
ShardRule = type | tuple[type, ...] | list[type] | Callable[[str, nn.Module], bool]

# One FSDP unit: a module, or the children of a bare container (ModuleList / ModuleDict: no forward) sharded as one
# group, as lucidrains-style ViTs hold a layer as nn.ModuleList([attention, feed_forward]).
Unit = nn.Module | list[nn.Module]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _bare(module: nn.Module) -> bool:
    """A ModuleList / ModuleDict without a forward of its own: fully_shard refuses it as a unit."""
    return isinstance(module, _CONTAINERS) and type(module).forward is nn.Module.forward


def _members(module: nn.Module) -> list[nn.Module]:
    if not _bare(module):
        return [module] if any(True for _ in module.parameters()) else []
    return [leaf for child in module.children() for leaf in _members(child)]


def _as_unit(module: nn.Module) -> Unit | None:
    members = _members(module)
    if not members:
        return None
    return members if _bare(module) else members[0]


def _matcher(shard: ShardRule) -> Callable[[str, nn.Module], bool]:
    if isinstance(shard, type):
        return lambda _name, m: isinstance(m, shard)
    if isinstance(shard, (tuple, list)):
        if not shard or not all(isinstance(c, type) for c in shard):
            raise ValueError("shard: give module classes (e.g. shard=[MyBlock]) or a predicate(name, module) -> bool")
        classes = tuple(shard)
        return lambda _name, m: isinstance(m, classes)
    if callable(shard):
        return shard
    raise ValueError(f"shard: {shard!r} is neither module classes nor a predicate(name, module) -> bool")


def _tied_across(model: nn.Module, unit: Unit) -> bool:
    """Does `unit` hold a parameter that a module outside it also holds (tied embeddings)? FSDP2 manages each
    parameter in exactly one group, so such a unit must be left to an enclosing one (the root, by default)."""
    members = unit if isinstance(unit, list) else [unit]
    inside = {id(m) for member in members for m in member.modules()}
    params = {id(p) for member in members for p in member.parameters()}
    for m in model.modules():
        if id(m) not in inside and any(id(p) in params for p in m.parameters(recurse=False)):
            return True
    return False


def fsdp_units(model: nn.Module, spec: ModelSpec | None = None, shard: ShardRule | None = None) -> list[Unit]:
    """The modules FSDP2 shards as units below the root, innermost first (the order fully_shard needs).

    `shard` names them (classes, or a predicate over `named_modules()`); else they are the blocks (the spec's, or
    the largest ModuleList / ModuleDict), else the root's direct children holding parameters. A match that is a
    bare container becomes one group of its children; a unit sharing a parameter with a module outside it (tied
    embeddings) is left to the enclosing unit. ValueError when `shard` matches nothing.
    """
    named: list[tuple[str, nn.Module]]
    if shard is not None:
        match = _matcher(shard)
        named = [(n, m) for n, m in model.named_modules() if n and match(n, m)]
        if not named:
            raise ValueError(
                f"shard: no module of the {type(model).__name__} matches {shard!r}; name classes it contains "
                f"(e.g. its block class) or leave shard=None to use its blocks"
            )
    else:
        found = block_container(model, spec)
        if found is not None:
            path, container = found
            named = [(f"{path}.{k}" if path else k, b) for k, b in block_items(container)]
        else:
            named = list(model.named_children())
    units: list[tuple[int, Unit]] = []
    for name, module in named:
        unit = _as_unit(module)
        if unit is not None and not _tied_across(model, unit):
            units.append((name.count(".") + (1 if isinstance(unit, list) else 0), unit))
    units.sort(key=lambda u: -u[0])  # stable: deeper first, model order within a depth
    return [u for _, u in units]
