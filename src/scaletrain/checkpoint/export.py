"""Exporting a distributed checkpoint into files others load, and importing Hugging Face weights.

Formats:
- safetensors: `model.safetensors` (or `model-0000i-of-0000N.safetensors` + index) with scaletrain's own parameter
  names (+ `config.json` of the model spec).
- torch: `model.pt`, a plain state dict readable with `torch.load(..., weights_only=True)`.
- diffusers: a folder as diffusers writes it (a diffusion model's: model_index.json, unet/ or transformer/,
  scheduler/), through the family's own writer (ModelSpec.export_folder; models/diffusion/).
- hf: a Hugging Face transformers folder (`config.json` + safetensors), through the model family's adapter
  (ModelSpec.hf; the built-in Llama's maps names and permutes the rotary projections, models/llama/hf.py; a
  `model.hf` model's reverses transformers' load-time conversions with transformers' own revert_weight_conversion,
  so packed MoE experts are written expert by expert as save_pretrained writes them).

safetensors and hf stream: the output files are planned from the DCP metadata alone (names, shapes, dtypes; the
conversion run on meta tensors; shards cut by huggingface_hub's split_torch_state_dict_into_shards, as
save_pretrained cuts them), then each file is filled by a DCP load of only the entries it needs, converted and
written before the next: peak memory is about one output shard (--max-shard-size; a packed MoE tensor whose experts
land in several files is read once per file), never the model. Several files come with model.safetensors.index.json,
as transformers writes them. torch (one `model.pt`) consolidates the whole model in this one process.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection
from pathlib import Path

import torch

from scaletrain.checkpoint.entries import natural_order, read_entries, saved_entries
from scaletrain.checkpoint.manifest import read_manifest
from scaletrain.models.registry import spec_from_manifest
from scaletrain.models.spec import ModelSpec


def manifest_spec(manifest: dict) -> ModelSpec:
    """The model spec a checkpoint manifest recorded (checkpoints before model_spec existed held Llama args)."""
    if "model_spec" in manifest:
        return spec_from_manifest(manifest["model_spec"])
    return spec_from_manifest({"family": "llama", "args": manifest["model_args"]})


DEFAULT_MAX_SHARD_SIZE = "2GB"  # per output file; export's peak memory is about this (decimal units, as the Hub's)
_UNITS = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """Bytes of a size written as `2GB`, `500MB`, `1.5GiB` or plain bytes; ValueError (one line) otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]I?B)?\s*", text, re.IGNORECASE)
    size = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()]) if m else 0
    if size < 1:
        raise ValueError(f"--max-shard-size: {text!r} is not a size; write it like 2GB, 500MB or 1GiB")
    return size


def _saved_model_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """Empty full-size tensors for every model entry DCP's metadata lists, keyed as saved (`model.<name>`): how a
    checkpoint of a model scaletrain cannot rebuild (a `scaletrain.setup()` user's own) is consolidated."""
    return {name: torch.empty(size, dtype=dtype) for name, (size, dtype) in saved_entries(ckpt).items()}


def _write_streamed(
    ckpt: Path,
    out: Path,
    entries: dict[str, tuple[torch.Size, torch.dtype]],
    convert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    max_shard_bytes: int,
    stem: str = "model",
    extra: dict[str, torch.Tensor] | None = None,
) -> list[Path]:
    """The checkpoint's model tensors, each converted by `convert` (names and layouts; tensor by tensor, so it is
    planned on meta tensors first), written as safetensors files of at most `max_shard_bytes` (a single larger
    tensor gets a file of its own) plus their index when there are several: one file in memory at a time.
    stem: the files' name (`<stem>.safetensors`, `<stem>-0000i-of-0000N.safetensors`, `<stem>.safetensors.index.json`).
    extra: whole tensors the checkpoint does not hold (frozen weights, frozen_weights()), written beside its own."""
    from huggingface_hub.serialization import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    outputs: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}  # output name -> the checkpoint entry it is made of
    extra = extra or {}
    entries = {**entries, **{n: (t.shape, t.dtype) for n, t in extra.items()}}
    meta = {name: torch.empty(size, dtype=dtype, device="meta") for name, (size, dtype) in entries.items()}
    for name, t in meta.items():
        for key, o in convert({name: t}).items():  # own storage: a view's would count its base's bytes
            outputs[key], source[key] = torch.empty(o.shape, dtype=o.dtype, device="meta"), name
    if set(convert(meta)) != set(outputs):  # a conversion that needs several entries at once (none today)
        raise ValueError(f"--format: {ckpt}'s weights cannot be converted one tensor at a time; export --format torch")
    split = split_torch_state_dict_into_shards(
        outputs, filename_pattern=stem + "{suffix}.safetensors", max_shard_size=max_shard_bytes
    )
    written = []
    for filename, keys in split.filename_to_tensors.items():
        needed = sorted({source[k] for k in keys}, key=natural_order)
        saved = read_entries(ckpt, {n: entries[n] for n in needed if n not in extra})
        converted = convert({n: extra[n] if n in extra else saved[n] for n in needed})
        save_file({k: converted[k].contiguous() for k in keys}, str(out / filename), metadata={"format": "pt"})
        written.append(out / filename)
        del converted
    if split.is_sharded:
        index = {
            "metadata": {"total_parameters": sum(o.numel() for o in outputs.values()), **split.metadata},
            "weight_map": split.tensor_to_filename,
        }
        path = out / f"{stem}.safetensors.index.json"
        path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written


def _committed_manifest(ckpt: Path) -> dict:
    manifest = read_manifest(ckpt)
    if manifest is None:
        raise ValueError(
            f"{ckpt}: not a committed scaletrain checkpoint (no manifest.json); "
            f"pick a step_NNNNNNNN folder listed by `scaletrain ckpt ls`"
        )
    return manifest


def load_full_model_state(ckpt: Path) -> tuple[dict[str, torch.Tensor], ModelSpec | None]:
    """The consolidated model weights of a committed checkpoint, read in this one process (no process group), and
    the model spec it recorded (None for a model saved by `scaletrain.setup()` without one). A LoRA checkpoint's
    weights are its base with the adapters merged in (checkpoint/adapters.py merged_state)."""
    from scaletrain.checkpoint.safe_load import load_dcp

    manifest = _committed_manifest(ckpt)
    spec: ModelSpec | None = None
    if manifest.get("lora") and ("model_spec" in manifest or "model_args" in manifest):
        # adapters on a frozen base: the model they trained, merged (the 4-bit base's values for QLoRA)
        from scaletrain.checkpoint.adapters import check_base, merged_state

        spec = manifest_spec(manifest)
        check_base(manifest["lora"], spec)
        return merged_state(ckpt, spec, manifest["lora"]), spec
    if "model_spec" in manifest or "model_args" in manifest:
        spec = manifest_spec(manifest)
        model = spec.build("meta")
        frozen = _frozen_names(model, saved_entries(ckpt))
        model.to_empty(device="cpu")
        if frozen:  # the frozen weights as the run made them; the checkpoint fills the others
            spec.init_weights(model, _run_seed(manifest, ckpt))
        weights = {k: v for k, v in model.state_dict().items() if k not in frozen}
    else:
        weights = _saved_model_state(ckpt)
        if not weights:
            raise ValueError(f"{ckpt}: holds no model weights (no 'model.' entries in its DCP metadata)")
    state = {"model": weights}
    load_dcp(state, ckpt, no_dist=True)
    if spec is not None:
        return model.state_dict(), spec
    return state["model"], spec


def _frozen_names(model: torch.nn.Module, saved: Collection[str]) -> set[str]:
    """The frozen weights of `model` (built from the checkpoint's spec) not among the checkpoint's `saved` entries
    (checkpoint/manager.py leaves them out: they never change in training)."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad and n not in saved}


def _run_seed(manifest: dict, ckpt: Path) -> int:
    if "seed" not in manifest:
        raise ValueError(
            f"{ckpt}: leaves its frozen weights out and records no run.seed to make them again (saved by "
            f"scaletrain.setup(), or by a scaletrain before 2026-12); export a checkpoint of `scaletrain train`"
        )
    return int(manifest["seed"])


def frozen_weights(ckpt: Path, manifest: dict, spec: ModelSpec, saved: Collection[str]) -> dict[str, torch.Tensor]:
    """The frozen weights the checkpoint (its `saved` entries) leaves out (model.freeze's parts, a vision tower's unused head), made as
    the run made them: model.hf's weights or the family's init by name from the run's seed. The whole model is
    built on this process's CPU for it (frozen parts are usually most of it); nothing when none are left out."""
    model = spec.build("meta")
    frozen = _frozen_names(model, saved)
    if not frozen:
        return {}
    seed = _run_seed(manifest, ckpt)
    model.to_empty(device="cpu")
    spec.init_weights(model, seed)
    state = model.state_dict()
    return {n: state[n].detach() for n in sorted(frozen, key=natural_order)}


def _hf(spec: ModelSpec | None, field: str):
    if spec is None:
        raise ValueError(
            f"{field}: this checkpoint holds a model saved by scaletrain.setup() without a model spec, so its "
            f"Hugging Face layout is unknown; use --format safetensors or torch (the model's own parameter names)"
        )
    if spec.hf is None:
        raise ValueError(f"{field}: the {spec.family} model family has no Hugging Face counterpart")
    return spec.hf


def export_checkpoint(
    ckpt: Path, out: Path, fmt: str, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
) -> list[Path]:
    """Write the weights of `ckpt` into folder `out` in format safetensors | hf (streamed: safetensors files of at
    most `max_shard_size` bytes, with an index when several) | torch (consolidated in memory)."""
    if fmt not in ("torch", "safetensors", "hf", "peft", "diffusers"):
        raise ValueError(f"--format: unknown format {fmt!r}; use safetensors, hf, peft, diffusers or torch")
    max_shard_bytes = parse_size(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    manifest = _committed_manifest(ckpt)
    spec = manifest_spec(manifest) if ("model_spec" in manifest or "model_args" in manifest) else None
    if "lora" in manifest and spec is not None:  # adapters only (checkpoint/adapters.py)
        return _export_lora(ckpt, out, fmt, spec, manifest["lora"], max_shard_bytes)
    if fmt == "peft":
        raise ValueError(f"--format peft: {ckpt} holds a full fine-tune, not LoRA adapters; use --format hf")
    hf = _hf(spec, "--format hf") if fmt == "hf" else None  # refused before reading any weights
    folder = _family_folder(spec, fmt) if fmt == "diffusers" else None
    if fmt == "torch":
        state, _ = load_full_model_state(ckpt)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "model.pt"
        torch.save(state, path)
        return [path]
    entries = saved_entries(ckpt)
    if not entries:
        raise ValueError(f"{ckpt}: holds no model weights (no 'model.' entries in its DCP metadata)")
    extra = frozen_weights(ckpt, manifest, spec, entries) if spec is not None else {}
    out.mkdir(parents=True, exist_ok=True)
    if hf is not None:
        return _write_streamed(ckpt, out, entries, hf.to_hf, max_shard_bytes, extra=extra) + hf.write_config(out)
    if folder is not None:
        weights = out / folder.weights_folder
        weights.mkdir(parents=True, exist_ok=True)
        written = _write_streamed(
            ckpt, weights, entries, folder.convert, max_shard_bytes, folder.weights_name, extra=extra
        )
        return written + folder.write_config(out)
    written = _write_streamed(ckpt, out, entries, lambda state: state, max_shard_bytes, extra=extra)
    if spec is None:
        return written
    (out / "config.json").write_text(json.dumps(spec.manifest(), indent=1))
    return [*written, out / "config.json"]


def _family_folder(spec: ModelSpec | None, fmt: str):
    """The family's writer of a format it adds (ModelSpec.export_folder); ValueError (one line) when it has none."""
    folder = spec.export_folder(fmt) if spec is not None else None
    if folder is None:
        family = f"the {spec.family} model family" if spec is not None else "a model saved without a model spec"
        raise ValueError(f"--format {fmt}: {family} has no {fmt} layout; use --format safetensors, hf or torch")
    return folder


def _export_lora(ckpt: Path, out: Path, fmt: str, spec: ModelSpec, lora: dict, max_shard_bytes: int) -> list[Path]:
    """A LoRA checkpoint: peft (the adapter folder), hf (merged into its base), safetensors/torch (the adapters
    under scaletrain's names). Every check runs before anything is written."""
    from scaletrain.checkpoint.adapters import check_base, export_merged, export_peft, read_adapters

    check_base(lora, spec)
    if fmt == "peft":
        return export_peft(ckpt, out, spec, lora)
    if fmt == "hf":
        return export_merged(ckpt, out, spec, lora)
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "torch":
        torch.save(read_adapters(ckpt), out / "adapters.pt")
        return [out / "adapters.pt"]
    return _write_streamed(ckpt, out, saved_entries(ckpt), lambda state: state, max_shard_bytes)


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
