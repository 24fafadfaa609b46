"""Consolidating a distributed checkpoint into one file set, and importing Hugging Face weights.

Formats:
- safetensors: `model.safetensors` with scaletrain's own parameter names (+ `config.json` of the model spec).
- torch: `model.pt`, a plain state dict readable with `torch.load(..., weights_only=True)`.
- hf: a Hugging Face transformers folder (`config.json` + safetensors), through the model family's adapter
  (ModelSpec.hf; the built-in Llama's maps names and permutes the rotary projections, models/llama/hf.py; a
  `model.hf` model is written by transformers' own save_pretrained: shards, index, per-expert MoE layout).

Every format consolidates the whole model in this one process (each tensor read from the DCP shards once).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from scaletrain.checkpoint.manifest import read_manifest
from scaletrain.models.registry import spec_from_manifest
from scaletrain.models.spec import ModelSpec


def manifest_spec(manifest: dict) -> ModelSpec:
    """The model spec a checkpoint manifest recorded (checkpoints before model_spec existed held Llama args)."""
    if "model_spec" in manifest:
        return spec_from_manifest(manifest["model_spec"])
    return spec_from_manifest({"family": "llama", "args": manifest["model_args"]})


def _saved_model_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """Empty full-size tensors for every model entry DCP's metadata lists, keyed as saved (`model.<name>`): how a
    checkpoint of a model scaletrain cannot rebuild (a `scaletrain.setup()` user's own) is consolidated."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from scaletrain.checkpoint.safe_load import METADATA_FILE, read_dcp_metadata

    with open(ckpt / METADATA_FILE, "rb") as f:
        meta = read_dcp_metadata(f, f"{ckpt.name}/{METADATA_FILE}")
    return {
        key.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
        for key, m in meta.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }


def load_full_model_state(ckpt: Path) -> tuple[dict[str, torch.Tensor], ModelSpec | None]:
    """The consolidated model weights of a committed checkpoint, read in this one process (no process group), and
    the model spec it recorded (None for a model saved by `scaletrain.setup()` without one)."""
    from scaletrain.checkpoint.safe_load import load_dcp

    manifest = read_manifest(ckpt)
    if manifest is None:
        raise ValueError(
            f"{ckpt}: not a committed scaletrain checkpoint (no manifest.json); "
            f"pick a step_NNNNNNNN folder listed by `scaletrain ckpt ls`"
        )
    spec: ModelSpec | None = None
    if "model_spec" in manifest or "model_args" in manifest:
        spec = manifest_spec(manifest)
        model = spec.build("meta")
        model.to_empty(device="cpu")
        weights = dict(model.state_dict())
    else:
        weights = _saved_model_state(ckpt)
        if not weights:
            raise ValueError(f"{ckpt}: holds no model weights (no 'model.' entries in its DCP metadata)")
    state = {"model": weights}
    load_dcp(state, ckpt, no_dist=True)
    return state["model"], spec


def _hf(spec: ModelSpec | None, field: str):
    if spec is None:
        raise ValueError(
            f"{field}: this checkpoint holds a model saved by scaletrain.setup() without a model spec, so its "
            f"Hugging Face layout is unknown; use --format safetensors or torch (the model's own parameter names)"
        )
    if spec.hf is None:
        raise ValueError(f"{field}: the {spec.family} model family has no Hugging Face counterpart")
    return spec.hf


def export_checkpoint(ckpt: Path, out: Path, fmt: str) -> list[Path]:
    """Write the consolidated weights of `ckpt` into folder `out` in format safetensors | torch | hf."""
    from safetensors.torch import save_file

    if fmt not in ("torch", "safetensors", "hf"):
        raise ValueError(f"--format: unknown format {fmt!r}; use safetensors, hf or torch")
    manifest = read_manifest(ckpt) or {}
    if fmt == "hf" and not ("model_spec" in manifest or "model_args" in manifest):
        _hf(None, "--format hf")  # refused before reading any weights
    state, spec = load_full_model_state(ckpt)
    hf = _hf(spec, "--format hf") if fmt == "hf" else None
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "torch":
        path = out / "model.pt"
        torch.save(state, path)
        return [path]
    if hf is not None:
        return hf.save(state, out)
    path = out / "model.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata={"format": "pt"})
    if spec is None:
        return [path]
    (out / "config.json").write_text(json.dumps(spec.manifest(), indent=1))
    return [path, out / "config.json"]


def read_hf_weights(folder: Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Hugging Face safetensors (one file or shards) as scaletrain-named fp32 tensors, the config checked."""
    from safetensors.torch import load_file

    hf = _hf(spec, "checkpoint.init_from_hf")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"checkpoint.init_from_hf: no *.safetensors in {str(folder)!r}")
    cfg_path = folder / "config.json"
    if cfg_path.is_file():
        hf.check_config(json.loads(cfg_path.read_text()))
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    return {k: v.float() for k, v in hf.from_hf(state).items()}


def load_hf_weights(model, folder: Path, spec: ModelSpec) -> None:
    """Overwrite the (possibly sharded) model's weights with a Hugging Face checkpoint's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state = read_hf_weights(folder, spec)
    set_model_state_dict(model, dict(state), options=StateDictOptions(full_state_dict=True, strict=True))
