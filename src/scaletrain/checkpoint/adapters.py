"""Exporting a LoRA checkpoint (adapters only, checkpoint/manager.py leaves the frozen base out): as a peft adapter
folder (`peft.PeftModel.from_pretrained` loads it onto the base) or merged into the base as a transformers folder.

The base is what the run started from: model.hf's folder weights, or the family's init by name from the recorded
seed. Names go through the family's HF adapter (ModelSpec.hf): a base weight `X.weight`'s adapters are
`X.lora_A` (rows: the rank, renamed only) and `X.lora_B` (rows: X's output rows, converted as X's weight is, e.g.
the built-in Llama's rotary permutation of wq/wk).
"""

from __future__ import annotations

from pathlib import Path

import torch

from scaletrain.models.lora import ADAPTER, base_fingerprint, nf4_round_trip
from scaletrain.models.spec import ModelSpec

PEFT_PREFIX = "base_model.model."  # peft's key prefix in adapter_model.safetensors


def read_adapters(ckpt: Path) -> dict[str, torch.Tensor]:
    """{plain name: tensor} of every adapter weight a LoRA checkpoint holds (the whole of its model state)."""
    from scaletrain.checkpoint.entries import read_entries, saved_entries

    return read_entries(ckpt, saved_entries(ckpt))


def _split(name: str) -> tuple[str, str]:
    """`layers.0.attention.wq.lora_A.default.weight` -> (`layers.0.attention.wq.weight`, `lora_A`)."""
    owner, which, rest = name.partition(".lora_")
    kind = "lora_" + rest.split(".")[0]
    return f"{owner}.weight", kind


def _hf_pairs(spec: ModelSpec, adapters: dict[str, torch.Tensor]) -> dict[tuple[str, str], torch.Tensor]:
    """{(HF base weight name, lora_A|lora_B): tensor in HF's layout}."""
    hf = spec.hf
    assert hf is not None
    base = dict(spec.build("meta").named_parameters())
    out = {}
    for name, t in adapters.items():
        base_name, kind = _split(name)
        from scaletrain.models.naming import plain_param_name

        shape = next(p.shape for n, p in base.items() if plain_param_name(n) == base_name)
        ((hf_name, _),) = hf.to_hf({base_name: torch.empty(shape, device="meta")}).items()
        out[(hf_name, kind)] = next(iter(hf.to_hf({base_name: t}).values())) if kind == "lora_B" else t
    return out


def check_base(lora: dict, spec: ModelSpec) -> None:
    """ValueError (one line) when the base rebuilt now (e.g. model.hf's folder, changed since) is not the one the
    adapters were trained on."""
    if lora.get("base") != base_fingerprint(spec):
        raise ValueError(
            f"--format: these adapters were trained on another base than {spec.describe()[:120]} (its hash "
            f"differs); export onto the model the run trained"
        )


def export_peft(ckpt: Path, out: Path, spec: ModelSpec, lora: dict) -> list[Path]:
    """adapter_config.json + adapter_model.safetensors, as peft's save_pretrained writes them."""
    from peft import LoraConfig as PeftLoraConfig
    from safetensors.torch import save_file

    if spec.hf is None:
        raise ValueError(f"--format peft: the {spec.family} model family has no Hugging Face counterpart")
    pairs = _hf_pairs(spec, read_adapters(ckpt))
    state = {
        f"{PEFT_PREFIX}{hf_name.removesuffix('.weight')}.{kind}.weight": t.contiguous()
        for (hf_name, kind), t in pairs.items()
    }
    targets = sorted({hf_name.removesuffix(".weight").rsplit(".", 1)[-1] for hf_name, _ in pairs})
    base_path = getattr(spec.args, "path", None)
    config = PeftLoraConfig(
        r=lora["rank"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        target_modules=targets,
        bias="none",
        base_model_name_or_path=str(base_path) if base_path else None,
        task_type="CAUSAL_LM",
    )
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return [out / "adapter_config.json", out / "adapter_model.safetensors"]


def base_state(spec: ModelSpec, lora: dict) -> dict[str, torch.Tensor]:
    """The frozen base the run trained on, in scaletrain's names: model.hf's weights or the init by name."""
    model = spec.build("meta")
    model.to_empty(device="cpu")
    spec.init_weights(model, int(lora["seed"]))
    from scaletrain.models.naming import plain_param_name

    return {plain_param_name(k): v.detach() for k, v in model.state_dict().items()}


def merged_state(ckpt: Path, spec: ModelSpec, lora: dict) -> dict[str, torch.Tensor]:
    """The model a LoRA checkpoint trained, as plain weights in scaletrain's names: the base with every adapter
    merged in, W + (alpha / rank) * B @ A, W being the 4-bit base's values for a QLoRA run (what its adapters were
    trained against)."""
    state = base_state(spec, lora)
    scale = lora["alpha"] / lora["rank"]
    adapters = read_adapters(ckpt)
    with torch.no_grad():
        for name, a in adapters.items():
            base_name, kind = _split(name)
            if kind != "lora_A":
                continue
            b = adapters[name.replace(".lora_A.", ".lora_B.")]
            base = state[base_name]
            if lora.get("quantize", "none") == "nf4":  # QLoRA: the 4-bit base the adapters were trained against
                base = nf4_round_trip(base)
            state[base_name] = base + scale * (b.float() @ a.float())
    return state


def export_merged(ckpt: Path, out: Path, spec: ModelSpec, lora: dict) -> list[Path]:
    """A transformers folder of merged_state (`--format peft` instead puts the adapters on any copy of the
    base)."""
    from safetensors.torch import save_file

    hf = spec.hf
    if hf is None:
        raise ValueError(f"--format hf: the {spec.family} model family has no Hugging Face counterpart")
    state = merged_state(ckpt, spec, lora)
    out.mkdir(parents=True, exist_ok=True)
    converted = {k: v.contiguous() for k, v in hf.to_hf(state).items()}
    save_file(converted, str(out / "model.safetensors"), metadata={"format": "pt"})
    return [out / "model.safetensors", *hf.write_config(out)]


def lora_of(manifest: dict) -> dict | None:
    return manifest.get("lora")


__all__ = ["ADAPTER", "check_base", "export_merged", "export_peft", "lora_of", "merged_state", "read_adapters"]
