"""Pipeline stages of a transformers causal LM: a pruned copy of the whole model that runs transformers' own
forward, so every family's mask building (causal, sliding window, per-layer types), rotary tables, embedding
scaling and logit soft-capping stay theirs.

A stage keeps its decoder layers under their whole-model indices (parameter names unchanged), the input embedding
only on the first stage, the final norm and output layer only on the last. The first stage feeds token ids, the
others feed the previous stage's hidden states as `inputs_embeds`; the base model then computes the position ids,
masks and rotary tables from their shape as it does for the whole model. What the base model does to the embedding
output before its layers (GPT-2: learned positions, dropout) is the first stage's: on later stages those modules
add nothing. Each stage's config copy says which layers it holds (`num_hidden_layers`, `layer_types`), because
transformers picks a layer's mask by its position in the list it runs.

A tied output layer keeps its embedding module on the last stage too (never called there: that stage is fed
`inputs_embeds`), so both stages name the shared weight as the whole model does and start from the same numbers;
the pipeline sums the two copies' gradients after every backward (Megatron's tying across stages)."""

from __future__ import annotations

import copy
from typing import Any, cast

import torch
from torch import nn


class StageLayers(nn.ModuleDict):
    """A stage's decoder layers keyed by their index in the whole model, read by transformers' forward as the
    ModuleList it was: iterated, indexed by position and sliced in order."""

    def __iter__(self):
        return iter(self._modules.values())

    def __getitem__(self, idx):
        if isinstance(idx, (int, slice)):
            return list(self._modules.values())[idx]
        return super().__getitem__(idx)


class NoPositions(nn.Module):
    """Stands for a learned position embedding on stages after the first: the hidden states they receive already
    carry the positions, so adding zero keeps transformers' `inputs_embeds + position_embeds` exact."""

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros((), device=position_ids.device)


def _is_norm(module: nn.Module) -> bool:
    return "Norm" in type(module).__name__


def outer_modules(spec: Any, model: nn.Module) -> tuple[str, dict[str, nn.Module]]:
    """(name of the layer list, {name: child}) of the base model's children other than the layer list."""
    base = spec._base(model)[1]
    container = spec.blocks(model)
    layers_attr = next(n for n, m in base.named_children() if m is container)
    return layers_attr, {n: m for n, m in base.named_children() if m is not container}


def check_stages(spec: Any) -> None:
    """ValueError (one line) when the base model holds parameters a stage could not place: anything besides the
    input embedding, learned positions (nn.Embedding), the final norm and parameter-free modules."""
    model = spec.meta_model
    emb = cast(Any, model).get_input_embeddings()
    _, outer = outer_modules(spec, model)
    for name, child in outer.items():
        if child is emb or _is_norm(child) or isinstance(child, nn.Embedding):
            continue
        if any(True for _ in child.parameters()):
            raise ValueError(
                f"parallel.pp: {spec.architecture} has parameters outside its decoder layers ({name}: "
                f"{type(child).__name__}) that scaletrain cannot place on a pipeline stage; use parallel.pp=1"
            )
    if sum(_is_norm(c) for c in outer.values()) > 1:
        raise ValueError(f"parallel.pp: {spec.architecture} has more than one final norm; use parallel.pp=1")


def _stage_forward(self: Any, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """tokens (first stage) or hidden states (later stages) -> hidden states, or logits on the last stage.
    position_ids: of packed rows (models/hf/packing.py), given to every stage."""
    info = self._scaletrain_stage
    kwargs: dict[str, Any] = {"input_ids": x} if info["first"] else {"inputs_embeds": x}
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    if info["last"]:
        return info["cls"].forward(self, **kwargs).logits
    return getattr(self, info["prefix"])(**kwargs).last_hidden_state


_STAGE_CLASSES: dict[type, type] = {}


def _stage_class(cls: type) -> type:
    if cls not in _STAGE_CLASSES:
        _STAGE_CLASSES[cls] = type(f"{cls.__name__}Stage", (cls,), {"forward": _stage_forward})
    return _STAGE_CLASSES[cls]


def cut_stage(spec: Any, model: nn.Module, stage: int, n_stages: int, bounds: tuple[int, int]) -> nn.Module:
    """A copy of `model` (meta: free) that is pipeline stage `stage` of `n_stages`, holding layers [bounds)."""
    first, last = stage == 0, stage == n_stages - 1
    prefix, _ = spec._base(model)
    part = copy.deepcopy(model)
    base = spec._base(part)[1]
    layers_attr, outer = outer_modules(spec, part)
    start, end = bounds
    whole = getattr(base, layers_attr)
    setattr(base, layers_attr, StageLayers({str(i): whole[i] for i in range(start, end)}))
    cfg: Any = part.config  # a copy (deepcopy above), shared by every module of this stage
    # written past the config's validation, which checks the two agree with each other, not with the model
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        cfg.__dict__["layer_types"] = list(types[start:end])
    layers_key = cfg.attribute_map.get("num_hidden_layers", "num_hidden_layers")
    cfg.__dict__[layers_key] = end - start
    emb = cast(Any, part).get_input_embeddings()
    for name, child in outer.items():
        if child is emb:
            if not first and not (last and spec.tied):  # a tied one stays with the head that shares its weight
                setattr(base, name, None)
        elif not first and isinstance(child, nn.Embedding):
            setattr(base, name, NoPositions())
        elif not first and isinstance(child, nn.Dropout):
            setattr(base, name, nn.Identity())
        elif not last and _is_norm(child):
            setattr(base, name, nn.Identity())
    if not last:
        out = cast(Any, part).get_output_embeddings()
        owner, _, attr = next(n for n, m in part.named_modules() if m is out).rpartition(".")
        setattr(part.get_submodule(owner), attr, None)
    cls = type(part)
    part.__class__ = _stage_class(cls)
    part._scaletrain_stage = {"first": first, "last": last, "cls": cls, "prefix": prefix}  # type: ignore[assignment]
    return part
