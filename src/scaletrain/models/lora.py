"""LoRA adapters on a model of any family, built with peft (no LoRA layers of our own).

Why under models/: adding adapters changes the model (its modules and parameters), like a family's build; the
layouts then treat the adapted model as any other (parallel/apply.py shards the frozen base and the adapters alike).
The family answers which modules are adapted by default (ModelSpec.lora_targets); nothing here names a module.
Under tensor parallelism the adapters follow their base layer's split (parallel/tensor_parallel.py adapter_tp_styles), so the math is exact.

QLoRA (lora.quantize='nf4'): the adapted layers' frozen base weights are stored as torchao's NF4Tensor (4-bit
NormalFloat in blocks of 64, block scales quantized again in blocks of 256: QLoRA's format). They are NF4 from the
meta build on, so FSDP2 shards them with NF4's own all-gather hooks; each weight is quantized whole once filled
(fill_base) and every rank keeps its rows, so every layout computes with the very values one process does.

Determinism: peft's base weights keep their plain names (`base_layer` is a wrapper component, models/naming.py),
so the family's init by name fills them as without LoRA; the adapters are filled here by name too (lora_B zeros,
lora_A from a generator seeded by (seed, name)), so every layout starts from the single-process numbers.
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from scaletrain.models.naming import is_adapter_name, plain_param_name

if TYPE_CHECKING:
    from torch import nn

    from scaletrain.config.schema import LoraConfig
    from scaletrain.models.spec import ModelSpec

ADAPTER = "default"  # peft's adapter name: the one adapter a job trains
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256  # QLoRA's blocks: 64 weights per scale, 256 scales per second-level scale
# a 4-bit base weight (each rank's rows of it) is made of whole second-level blocks: its size a multiple of this
NF4_GRANULE = NF4_BLOCK * NF4_SCALER_BLOCK


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


def check_lora(cfg: LoraConfig, spec: ModelSpec) -> list[tuple[str, tuple[int, int]]]:
    """ValueError (one line naming the field) when the targets match no linear of the model or the rank exceeds
    a target's smaller dimension; else (path, (out, in) features) of each adapted linear (check_quantize reads
    them). Reads the model on meta: no memory, no time."""
    from torch import nn

    if cfg.rank == 0:
        return []
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
    return [(name, (module.out_features, module.in_features)) for name, module in found]


def add_lora(model: nn.Module, cfg: LoraConfig, spec: ModelSpec) -> nn.Module:
    """`model` (on meta) with peft's LoRA layers on the targets, every other weight frozen, the adapted layers' base
    weights NF4 with lora.quantize='nf4'; returns it."""
    from scaletrain.models.library_noise import quiet_imports

    with quiet_imports():  # peft imports torchao where it is installed (models/library_noise.py)
        from peft import inject_adapter_in_model

    targets = lora_targets(cfg, spec)
    model = inject_adapter_in_model(_peft_config(cfg, targets), model, adapter_name=ADAPTER, low_cpu_mem_usage=True)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_name(plain_param_name(name)))
    if cfg.quantize == "nf4":
        from torch import nn as _nn

        with quiet_imports():
            from torchao.quantization import to_nf4

        for _, base in _adapted_bases(model):
            w = base.weight
            base.weight = _nn.Parameter(to_nf4(w.detach(), NF4_BLOCK, NF4_SCALER_BLOCK), requires_grad=False)
    return model


def _adapted_bases(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(path, base linear) of every peft LoRA layer of `model`."""
    return [(n, m.base_layer) for n, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]


def _is_nf4(t) -> bool:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return type(local).__name__ == "NF4Tensor"


def quantized_base_names(model: nn.Module) -> list[str]:
    """Names (as `model` has them) of its NF4 base weights."""
    return [n for n, p in model.named_parameters() if _is_nf4(p)]


def _placed_like(local, like):
    """`local` as a DTensor placed as the DTensor `like` (its mesh, placements, global shape and stride)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def fill_base(model: nn.Module, fill: Callable[[nn.Module], None]) -> None:
    """Run `fill` (the family's init by name, or its HF folder's weights) on `model`; with a 4-bit base, each NF4
    weight is first swapped for a plain one of its shape and placement, then, once filled, quantized whole (an
    all-gather of one weight at a time) and each rank keeps its rows of the result. Quantizing whole keeps the
    block scales' shared mean of the unsplit weight, so a sharded base equals the single-process one bit for bit.

    The NF4 parameter objects are replaced (a module attribute set), not copied into: FSDP2 picks the new sharded
    parameter up at its lazy init, as after load_state_dict(assign=True)."""
    import torch
    from torch import nn as _nn
    from torch.distributed.tensor import DTensor

    swapped = [base for _, base in _adapted_bases(model) if _is_nf4(base.weight)]
    for base in swapped:
        w = base.weight
        new: torch.Tensor
        if isinstance(w, DTensor):
            local = w.to_local()
            new = _placed_like(torch.empty(local.shape, dtype=local.dtype, device=local.device), w)
        else:
            new = torch.empty(w.shape, dtype=w.dtype, device=w.device)
        base.weight = _nn.Parameter(new, requires_grad=False)
    fill(model)
    if not swapped:
        return
    from torchao.quantization import to_nf4

    with torch.no_grad():
        for base in swapped:
            w = base.weight
            whole = w.full_tensor() if isinstance(w, DTensor) else w.detach()
            q = to_nf4(whole.contiguous(), NF4_BLOCK, NF4_SCALER_BLOCK)
            if isinstance(w, DTensor):
                q = _placed_like(_rows_of_rank(q, w), w)
            base.weight = _nn.Parameter(q, requires_grad=False)


def _rows_of_rank(q, w):
    """This rank's part of the whole NF4 weight `q` as the DTensor `w` places it: chunked along dim 0 on each mesh
    dimension that shards it, in mesh order (DTensor's own split; NF4's chunk keeps the whole weight's scales).
    Only row shards occur here (FSDP2's Shard(0)): a 4-bit base under TP is refused before launch."""
    for dim, placement in enumerate(w.placements):
        if placement.is_shard():
            if placement.dim != 0:
                raise ValueError(f"lora.quantize: a 4-bit base cannot be split along dim {placement.dim}")
            q = q.chunk(w.device_mesh.size(dim), dim=0)[w.device_mesh.get_local_rank(dim)]
    return q


def dequantized(state: dict) -> dict:
    """A state dict whose NF4 weights (a 4-bit base, plain or a DTensor over NF4 rows) are given dequantized in
    their own dtype, as plain tensors or DTensors over the plain rows; everything else as it is."""
    from torch.distributed.tensor import DTensor

    out = dict(state)
    for key, value in state.items():
        if not _is_nf4(value):
            continue
        if isinstance(value, DTensor):
            out[key] = _placed_like(value.to_local().get_original_weight(), value)  # type: ignore[attr-defined]
        else:
            out[key] = value.get_original_weight()
    return out


def nf4_round_trip(weight):
    """`weight` as a 4-bit base computes with it: quantized whole to NF4 and read back in its dtype."""
    from torchao.quantization import to_nf4

    return to_nf4(weight.contiguous(), NF4_BLOCK, NF4_SCALER_BLOCK).get_original_weight()


def whole_nf4_shards(rows: int, cols: int, shards: int) -> bool:
    """Whether a rows x cols weight splits into `shards` FSDP2 row shards each made of whole NF4 blocks."""
    return rows % shards == 0 and (rows // shards) * cols % NF4_GRANULE == 0


def check_quantize(cfg: LoraConfig, adapted: list[tuple[str, tuple[int, int]]], shards: int) -> None:
    """ValueError (one line) when the 4-bit base cannot be built: torchao missing, or an adapted weight (`adapted`:
    check_lora's (path, (rows, cols)); each of `shards` FSDP row shards of it) not made of whole NF4 blocks."""
    from scaletrain.config.extras import require

    if cfg.quantize == "none" or cfg.rank == 0:
        return
    require("torchao", "lora.quantize", extra="qlora")
    for name, (rows, cols) in adapted:
        if not whole_nf4_shards(rows, cols, shards):
            per = f"{rows // shards}x{cols} rows per shard" if shards > 1 else f"{rows}x{cols}"
            raise ValueError(
                f"lora.quantize: {name} ({per}) is not made of whole NF4 blocks ({NF4_BLOCK} weights x "
                f"{NF4_SCALER_BLOCK} scales = {NF4_GRANULE}); leave it out of lora.targets, use fewer FSDP shards, "
                f"or lora.quantize='none'"
            )


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
        "quantize": cfg.quantize,  # the base the adapters were trained against ('nf4': its 4-bit copy)
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
