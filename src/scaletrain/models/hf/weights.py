"""Weights of a Hugging Face folder: checked against the model before launch (names and shapes from the
safetensors headers, no tensor read), loaded per rank (each parameter's local shard read as a slice of its
safetensors entry, so no rank holds the whole model), and the adapter export uses (names are transformers' own)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from scaletrain.models.naming import plain_param_name
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


def check_weights(spec: Any, folder: str | Path) -> None:
    """ValueError (one line) when the folder's weights do not fit the model its config.json describes."""
    from safetensors import safe_open

    where = weight_files(folder)
    if not where:
        return
    expected = {n: tuple(t.shape) for n, t in spec.meta_model.state_dict().items()}
    tied = _tied_key(spec)
    extra = sorted(set(where) - set(expected))
    if extra and spec.n_experts:
        raise ValueError(
            f"model.hf: {where[extra[0]].name} stores experts one by one ({extra[0]!r}) while transformers "
            f"{spec.architecture} packs them; scaletrain does not convert that layout yet: start it from random "
            f"weights (a folder with config.json only)"
        )
    if extra:
        raise ValueError(
            f"model.hf: {where[extra[0]].name} holds {extra[0]!r}, which {spec.architecture} built from config.json "
            f"has no parameter for ({len(extra)} such tensors); the weights belong to another model"
        )
    missing = sorted(n for n in set(expected) - set(where) if n != tied)
    if missing:
        raise ValueError(
            f"model.hf: the safetensors files in {str(folder)!r} lack {missing[0]!r} ({len(missing)} tensors "
            f"missing); the weights are incomplete or belong to another model"
        )
    for name, path in where.items():
        with safe_open(str(path), framework="pt") as h:
            shape = tuple(h.get_slice(name).get_shape())
        if shape != expected[name]:
            raise ValueError(
                f"model.hf: weight {name!r} in {path.name} has shape {list(shape)}, config.json makes it "
                f"{list(expected[name])}; the weights and config.json describe different models"
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


def load_weights(model: nn.Module, folder: str | Path) -> None:
    """Copy the folder's weights into `model` (plain, or sharded by FSDP2 / TP: each rank reads only its own
    slice of each tensor). Memory: one parameter's shard at a time (a whole tensor for strided 2-D shards)."""
    import torch
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, distribute_tensor

    where = weight_files(folder)
    handles: dict[Path, Any] = {}
    try:
        with torch.no_grad():
            for name, p in model.named_parameters():
                key = plain_param_name(name)
                path = where[key]
                if path not in handles:
                    handles[path] = safe_open(str(path), framework="pt")
                entry = handles[path].get_slice(key)
                local = p.to_local() if isinstance(p, DTensor) else p
                piece = _local_slice(p)
                if piece is None:
                    full = entry[:].to(torch.float32)
                    dt = cast(DTensor, p)
                    local.copy_(distribute_tensor(full, dt.device_mesh, dt.placements, src_data_rank=None).to_local())
                    continue
                shape, offset = piece
                index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
                local.copy_(entry[index] if index else entry[:])
    finally:
        handles.clear()


class HFFolderAdapter(HFAdapter):
    """Our state dict and transformers' are the same names (the model is transformers' own); a tied output
    layer is left out on export, as save_pretrained does, and filled from the embedding on import."""

    def __init__(self, spec: Any):  # an HFSpec (not imported: spec.py imports this module)
        self.spec = spec

    def config(self) -> dict:
        cfg = self.spec.args.config_dict
        cfg["dtype"] = "float32"
        return cfg

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tied = _tied_key(self.spec)
        return {k: v.contiguous() for k, v in state.items() if k != tied}

    def from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(state)
        tied = _tied_key(self.spec)
        if tied is not None and tied not in out:
            emb = cast(Any, self.spec.meta_model).get_input_embeddings()
            emb_name = next(n for n, m in self.spec.meta_model.named_modules() if m is emb) + ".weight"
            out[tied] = out[emb_name]
        return out

    def check_config(self, hf_config: dict) -> None:
        if json.dumps(hf_config, sort_keys=True) != self.spec.args.config:
            raise ValueError("checkpoint.init_from_hf: the folder's config.json differs from model.hf's")
