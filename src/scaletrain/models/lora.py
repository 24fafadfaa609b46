"""LoRA adapters on a model of any family, built with peft (no LoRA layers of our own).

Why under models/: adding adapters changes the model (its modules and parameters), like a family's build; the
layouts then treat the adapted model as any other (parallel/apply.py shards the frozen base and the adapters alike).
The family answers which modules are adapted by default (ModelSpec.lora_targets); nothing here names a module.
Under tensor parallelism the adapters follow their base layer's split (parallel/tensor_parallel.py adapter_tp_styles), so the math is exact.

Determinism: peft's base weights keep their plain names (`base_layer` is a wrapper component, models/naming.py),
so the family's init by name fills them as without LoRA; the adapters are filled here by name too (lora_B zeros,
lora_A from a generator seeded by (seed, name)), so every layout starts from the single-process numbers.
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from typing import TYPE_CHECKING

from scaletrain.models.naming import is_adapter_name, plain_param_name

if TYPE_CHECKING:
    from torch import nn

    from scaletrain.config.schema import LoraConfig
    from scaletrain.models.spec import ModelSpec

ADAPTER = "default"  # peft's adapter name: the one adapter a job trains


def lora_targets(cfg: LoraConfig, spec: ModelSpec) -> list[str]:
    return list(cfg.targets) if cfg.targets else spec.lora_targets()


def _peft_config(cfg: LoraConfig, targets: list[str]):
    try:
        from peft import LoraConfig as PeftLoraConfig
    except ImportError:
        raise ValueError("lora.rank: LoRA needs peft; pip install 'scaletrain[hf]'") from None
    return PeftLoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets, bias="none"
    )


def _matches(module_name: str, targets: list[str]) -> bool:
    """peft's rule for a list of target_modules: the name is a target or ends with `.target`."""
    return any(module_name == t or module_name.endswith("." + t) for t in targets)


def check_lora(cfg: LoraConfig, spec: ModelSpec) -> None:
    """ValueError (one line naming the field) when the targets match no linear of the model or the rank exceeds
    a target's smaller dimension. Reads the model on meta: no memory, no time."""
    from torch import nn

    if cfg.rank == 0:
        return
    targets = lora_targets(cfg, spec)
    model = spec.build("meta")
    found = [(n, m) for n, m in model.named_modules() if _matches(n, targets)]
    if not found:
        raise ValueError(
            f"lora.targets: {targets} match no module of the {spec.family} model; name its linear layers "
            f"(e.g. {', '.join(spec.lora_targets())})"
        )
    for name, module in found:
        if not isinstance(module, nn.Linear):
            raise ValueError(f"lora.targets: {name} is a {type(module).__name__}, not a linear layer; leave it out")
        smallest = min(module.in_features, module.out_features)
        if cfg.rank > smallest:
            raise ValueError(
                f"lora.rank: {cfg.rank} is larger than {name}'s smaller dimension {smallest}; use lora.rank <= {smallest}"
            )


def add_lora(model: nn.Module, cfg: LoraConfig, spec: ModelSpec) -> nn.Module:
    """`model` (on meta) with peft's LoRA layers on the targets, every other weight frozen; returns it."""
    from peft import inject_adapter_in_model

    targets = lora_targets(cfg, spec)
    model = inject_adapter_in_model(_peft_config(cfg, targets), model, adapter_name=ADAPTER, low_cpu_mem_usage=True)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_name(plain_param_name(name)))
    return model


def adapter_init_std(name: str, fan_in: int) -> float:
    """lora_B: zeros (the adapted model starts as the base); lora_A: std 1/sqrt(fan_in) (peft's kaiming-uniform
    has this order of scale; a normal by name keeps every layout on the same numbers)."""
    return 0.0 if ".lora_B." in name or name.startswith("lora_B.") else 1.0 / math.sqrt(fan_in)


def init_adapters(model: nn.Module, seed: int) -> None:
    """Fill the adapter weights of `model` (plain or sharded) by name, as init_by_name fills a family's."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, p in model.named_parameters():
            clean = plain_param_name(name)
            if not is_adapter_name(clean):
                continue
            std = adapter_init_std(clean, p.shape[-1])
            full = torch.zeros(p.shape, dtype=torch.float32)
            if std:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(clean.encode()))
                full.normal_(0.0, std, generator=gen)
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
            else:
                p.copy_(full)


def base_fingerprint(spec: ModelSpec) -> str:
    """sha256 of the base model's manifest entry (family and shape): what an adapter checkpoint belongs to."""
    text = json.dumps(spec.manifest(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def lora_manifest(cfg: LoraConfig, spec: ModelSpec, seed: int) -> dict:
    """What a checkpoint of adapters records: the LoRA settings and the base they were trained on (its manifest
    hash, and the seed its weights were filled from when the family's init made them)."""
    return {
        "seed": seed,
        "rank": cfg.rank,
        "alpha": cfg.alpha,
        "dropout": cfg.dropout,
        "targets": lora_targets(cfg, spec),
        "base": base_fingerprint(spec),
    }


def linear_layers(module: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(path, linear) of every linear `module` computes, as the model without LoRA has them: a peft LoRA layer is
    listed under its own path with its base linear, its adapter and base_layer children left out."""
    from torch import nn

    found: list[tuple[str, nn.Linear]] = []
    wrappers: list[str] = []
    for name, m in module.named_modules():  # pre-order: a LoRA layer comes before its children
        if any(name.startswith(w + ".") for w in wrappers):
            continue
        base = getattr(m, "base_layer", None) if hasattr(m, "lora_A") else None
        if isinstance(base, nn.Linear):
            wrappers.append(name)
            found.append((name, base))
        elif isinstance(m, nn.Linear):
            found.append((name, m))
    return found
