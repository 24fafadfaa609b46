"""Weights of a Hugging Face folder: checked against the model before launch (names and shapes from the
safetensors headers, no tensor read), loaded per rank (each parameter's local shard read as a slice of its
safetensors entry, so no rank holds the whole model), and the adapter export uses (names are transformers' own)."""

from __future__ import annotations

from scaletrain.config.errors import FieldError

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from scaletrain.models.naming import is_adapter_name, plain_param_name
from scaletrain.models.spec import HFAdapter

if TYPE_CHECKING:
    import torch
    from torch import nn


def has_weights(folder: str | Path) -> bool:
    return any(Path(folder).glob("*.safetensors"))


def weight_files(folder: str | Path) -> dict[str, Path]:
    """{tensor name: the safetensors file holding it} of a folder (one file or shards)."""
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                where[name] = f
    return where


def _tied_key(spec: Any) -> str | None:
    """The output layer's weight name when it is tied to the input embedding (files may omit it)."""
    if not spec.tied:
        return None
    m = cast(Any, spec.meta_model)
    out = m.get_output_embeddings()
    return next((n for n, mod in m.named_modules() if mod is out), "lm_head") + ".weight"


class Layout:
    """How a folder's tensors make the model's parameters. `direct`: {parameter: file key} read as stored;
    `packed`: {parameter: [[file key of expert e, for e in experts] for each source]}, the per-expert tensors that
    transformers packs on load into one [experts, rows, cols] parameter (sources stacked over experts, then
    concatenated along the rows: gate then up), read from transformers' own conversion mapping of the model;
    `extra`: file keys no parameter is made of. Names only: no tensor is read."""

    def __init__(self, spec: Any, keys: list[str]):
        import re

        from transformers.conversion_mapping import extract_weight_conversions_for_model
        from transformers.core_model_loading import (
            Concatenate,
            MergeModulelist,
            WeightConverter,
            WeightRenaming,
            apply_renamings,
            rename_source_key,
        )

        transforms = extract_weight_conversions_for_model(spec.meta_model) or []
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        expected = set(spec.meta_model.state_dict())
        self.direct: dict[str, str] = {}
        self.extra: list[str] = []
        found: dict[str, dict[int, dict[int, str]]] = {}
        for key in keys:
            name, pattern = rename_source_key(key, renamings, converters)
            if pattern is None:
                if name in expected:
                    self.direct[name] = key
                else:
                    self.extra.append(key)
                continue
            conv = next(c for c in converters if pattern in c.source_patterns)
            ops = [(type(op), getattr(op, "dim", None)) for op in conv.operations]
            if ops not in ([(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)]):
                raise FieldError(
                    "model.hf",
                    f"{key!r} is stored in a layout transformers converts with "
                    f"{[type(op).__name__ for op in conv.operations]}, which scaletrain cannot read per shard; "
                    f"save the model with save_pretrained of a transformers version that packs it, or start from "
                    f"config.json only",
                )
            star = re.escape(pattern).replace(r"\*", r"(\d+)")
            expert = int(re.search(star, apply_renamings(key, renamings)).group(1))  # type: ignore[union-attr]
            found.setdefault(name, {}).setdefault(conv.source_patterns.index(pattern), {})[expert] = key
        self.packed = {
            name: [[by_expert[e] for e in sorted(by_expert)] for _, by_expert in sorted(sources.items())]
            for name, sources in found.items()
        }

    def covers(self, name: str) -> bool:
        return name in self.direct or name in self.packed


def check_weights(spec: Any, folder: str | Path) -> None:
    """ValueError (one line) when the folder's weights do not fit the model its config.json describes."""
    from safetensors import safe_open

    where = weight_files(folder)
    if not where:
        return
    expected = {n: tuple(t.shape) for n, t in spec.meta_model.state_dict().items()}
    tied = _tied_key(spec)
    layout = Layout(spec, sorted(where))
    if layout.extra:
        extra = sorted(layout.extra)
        raise FieldError(
            "model.hf",
            f"{where[extra[0]].name} holds {extra[0]!r}, which {spec.architecture} built from config.json "
            f"has no parameter for ({len(extra)} such tensors); the weights belong to another model",
        )
    missing = sorted(n for n in expected if not layout.covers(n) and n != tied)
    if missing:
        raise FieldError(
            "model.hf",
            f"the safetensors files in {str(folder)!r} lack {missing[0]!r} ({len(missing)} tensors "
            f"missing); the weights are incomplete or belong to another model",
        )

    def shape_of(key: str) -> tuple[int, ...]:
        with safe_open(str(where[key]), framework="pt") as h:
            return tuple(h.get_slice(key).get_shape())

    for name, sources in layout.packed.items():
        shapes = [{shape_of(k) for k in per_expert} for per_expert in sources]
        if any(len(s) != 1 or len(next(iter(s))) != 2 for s in shapes) or len({len(p) for p in sources}) != 1:
            raise FieldError("model.hf", f"the experts of {name!r} differ in shape or count; the weights are broken")
        rows = sum(next(iter(s))[0] for s in shapes)
        packed = (len(sources[0]), rows, next(iter(shapes[0]))[1])
        if packed != expected[name]:
            raise FieldError(
                "model.hf",
                f"the {len(sources[0])} experts' tensors for {name!r} pack to shape {list(packed)}, "
                f"config.json makes it {list(expected[name])}; the weights and config.json describe different models",
            )
    for name, key in layout.direct.items():
        shape = shape_of(key)
        if shape != expected[name]:
            raise FieldError(
                "model.hf",
                f"weight {name!r} in {where[key].name} has shape {list(shape)}, config.json makes it "
                f"{list(expected[name])}; the weights and config.json describe different models",
            )


def _local_slice(p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(local shape, global offset) of this rank's piece of a parameter; None when it is not a plain
    block of the full tensor (strided shards of FSDP over TP), which is then read whole."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(p, DTensor):
        return tuple(p.shape), (0,) * p.dim()
    if not all(type(pl) in (Shard, Replicate) for pl in p.placements):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)


class _Reader:
    """Blocks of the folder's tensors, each read as a slice of its safetensors entries (bytes read: the block's)."""

    def __init__(self, spec: Any, folder: str | Path):
        self.where = weight_files(folder)
        self.layout = Layout(spec, sorted(self.where))
        tied = _tied_key(spec)
        if tied is not None and tied not in self.layout.direct:  # a tied output layer is the embedding
            emb = cast(Any, spec.meta_model).get_input_embeddings()
            emb_name = next(n for n, m in spec.meta_model.named_modules() if m is emb) + ".weight"
            self.layout.direct[tied] = self.layout.direct[emb_name]

    def entry(self, key: str, index: tuple[slice, ...] | None = None) -> Any:
        """The block of one stored tensor (its shape when index is None). The file is opened per read: safetensors
        memory-maps it, and pages left mapped would count in this rank's resident memory until the end."""
        from safetensors import safe_open

        with safe_open(str(self.where[key]), framework="pt") as h:
            entry = h.get_slice(key)
            if index is None:
                return entry.get_shape()
            return entry[index] if index else entry[:]

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """Block `index` of parameter `name` (whole slices: the full tensor)."""
        import torch

        if name in self.layout.direct:
            return self.entry(self.layout.direct[name], index)
        experts, rows, cols = index
        out = []
        for e in range(*experts.indices(len(self.layout.packed[name][0]))):
            parts, at = [], 0
            for per_expert in self.layout.packed[name]:
                n = self.entry(per_expert[e])[0]
                lo, hi = max(rows.start or 0, at), min(n + at if rows.stop is None else rows.stop, at + n)
                if lo < hi:
                    parts.append(self.entry(per_expert[e], (slice(lo - at, hi - at), cols)))
                at += n
            out.append(torch.cat(parts))
        return torch.stack(out)


def load_weights(model: nn.Module, folder: str | Path, spec: Any) -> None:
    """Copy the folder's weights into `model` (plain, or sharded by FSDP2 / TP / PP: each rank reads only its own
    slice of each tensor; per-expert tensors are packed as transformers packs them). Memory: one parameter's
    shard at a time (a whole tensor for strided 2-D shards)."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    reader = _Reader(spec, folder)
    with torch.no_grad():
        for name, p in model.named_parameters():
            key = plain_param_name(name)
            if is_adapter_name(key):  # LoRA's weights are not in the base folder (models/lora.py fills them)
                continue
            local = p.to_local() if isinstance(p, DTensor) else p
            piece = _local_slice(p)
            if piece is None:
                full = reader.read(key, (slice(None),) * p.dim()).to(torch.float32)
                dt = cast(DTensor, p)
                local.copy_(distribute_tensor(full, dt.device_mesh, dt.placements, src_data_rank=None).to_local())
                continue
            shape, offset = piece
            local.copy_(reader.read(key, tuple(slice(o, o + s) for o, s in zip(offset, shape))))


class HFFolderAdapter(HFAdapter):
    """Our state dict and transformers' are the same names (the model is transformers' own); on export a tied
    output layer is left out and per-expert weights are written expert by expert, as save_pretrained does; on
    import the tied layer is filled from the embedding."""

    def __init__(self, spec: Any):  # an HFSpec (not imported: spec.py imports this module)
        self.spec = spec

    def config(self) -> dict:
        cfg = self.spec.args.config_dict
        cfg["dtype"] = "float32"
        return cfg

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Without the tied output layer, and in the layout save_pretrained writes: transformers' own reverse of its
        load-time conversions (packed MoE experts split back into per-expert tensors), each tensor on its own."""
        from transformers.core_model_loading import revert_weight_conversion

        tied = _tied_key(self.spec)
        return revert_weight_conversion(self.spec.meta_model, {k: v for k, v in state.items() if k != tied})

    def from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(state)
        tied = _tied_key(self.spec)
        if tied is not None and tied not in out:
            emb = cast(Any, self.spec.meta_model).get_input_embeddings()
            emb_name = next(n for n, m in self.spec.meta_model.named_modules() if m is emb) + ".weight"
            out[tied] = out[emb_name]
        return out

    def causal_lm(self, state: dict[str, torch.Tensor]) -> Any:
        """transformers' own model of the folder's config with the KV cache on and `state` (already its names and
        packed layout) loaded; the tied output layer follows the embedding."""
        import copy

        config = copy.deepcopy(self.spec.config)
        config.use_cache = True
        model = self.spec.build_for_inference(config)
        model.load_state_dict(self.from_hf(state), strict=True)
        self.spec.tie(model)
        return model.eval()

    def write_config(self, out: Path) -> list[Path]:
        """config.json as the folder's own (not the training copy, which turns use_cache off), and
        generation_config.json where save_pretrained writes one (models that generate)."""
        written = super().write_config(out)
        model = cast(Any, self.spec.meta_model)
        if model.can_generate():
            model.generation_config.save_pretrained(out)
            written.append(out / "generation_config.json")
        return written

    def check_config(self, hf_config: dict) -> None:
        if json.dumps(hf_config, sort_keys=True) != self.spec.args.config:
            raise ValueError("checkpoint.init_from_hf: the folder's config.json differs from model.hf's")
