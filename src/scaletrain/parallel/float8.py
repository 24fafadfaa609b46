"""FP8 training through torchao's float8 (`convert_to_float8_training`), the first step of the layout order: the
blocks' linears become `Float8Linear` on the meta-device model, before the pipeline split, TP and FSDP (as in
torchtitan), so TP and FSDP shard the converted weights.

Recipes (`precision.fp8`), on top of bf16 compute:
- tensorwise: one dynamic scale per tensor. Under FSDP2 the weights are all-gathered in float8
  (`enable_fsdp_float8_all_gather`: half the bytes of a bf16 all-gather) and their scales are computed for all
  weights at once after each optimizer step (`precompute_float8_dynamic_scale_for_fsdp`, one all-reduce instead of
  one per weight in the next forward). Under TP the float8 styles cast before the TP all-gather.
- rowwise: one scale per row (power-of-2 scales); more accurate, no float8 all-gather (torchao supports that only
  tensorwise), plain TP styles.

Only linears inside the blocks are converted, and only those whose every dimension (on every TP rank) is a multiple
of 16 (what the fp8 matmul `torch._scaled_mm` requires): the output layer and the embedding stay in high precision.
On a CPU the matmuls are emulated (`Float8LinearConfig(emulate=True)`: the same casts and scales, the matmul in
fp32), which is how every layout is tested here; on CUDA the real fp8 matmuls need compute capability 8.9
(Ada, Hopper) or newer.

torchao is imported only here and only when fp8 is on: `import scaletrain` and the command never load it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from scaletrain.models.library_noise import quiet_imports
from scaletrain.models.spec import ModelSpec
from scaletrain.parallel.blocks import block_container

FP8_RECIPES = ("tensorwise", "rowwise")  # precision.fp8's values besides "none"
FP8_COMPUTE_DTYPE = "bf16"  # the compute dtype fp8 runs on top of
FP8_MIN_CAPABILITY = (8, 9)  # CUDA compute capability with fp8 tensor cores (Ada 8.9, Hopper 9.0)
FP8_DIM_MULTIPLE = 16  # torch._scaled_mm needs both matmul dims of the weight divisible by 16


def check_float8_device(fp8: str, device_type: str) -> None:
    """ValueError (one line) when fp8 is on and this host's GPU has no fp8 matmuls; CPUs emulate them."""
    if fp8 == "none" or device_type != "cuda":
        return
    cap = torch.cuda.get_device_capability()
    if cap < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name()
        raise ValueError(
            f"precision.fp8: {fp8} needs a GPU with fp8 matmuls (compute capability >= 8.9: Ada, Hopper or "
            f"newer); {name} has {cap[0]}.{cap[1]}; set precision.fp8=none"
        )


def _torchao_float8() -> Any:
    """torchao.float8, imported quietly: on a host without CUDA torchao logs a warning for each CUDA-only kernel
    library it cannot load, which says nothing about fp8 training (emulated there)."""
    with quiet_imports():  # also torch's pytree warning about torchao's Enums (models/library_noise.py)
        import torchao.float8 as float8
    return float8


def float8_config(recipe: str, emulate: bool, fsdp_all_gather: bool) -> Any:
    """torchao's Float8LinearConfig for a recipe. fsdp_all_gather (tensorwise under FSDP2 only): all-gather the
    weights in float8."""
    float8 = _torchao_float8()
    if recipe == "tensorwise":
        return float8.Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_all_gather, emulate=emulate)
    if recipe == "rowwise":
        import dataclasses

        return dataclasses.replace(float8.Float8LinearConfig.from_recipe_name("rowwise"), emulate=emulate)
    raise ValueError(f"precision.fp8: unknown recipe {recipe!r}; choose from none, {', '.join(FP8_RECIPES)}")


def float8_filter(model: nn.Module, spec: ModelSpec | None, tp: int = 1) -> Callable[[nn.Module, str], bool]:
    """Which linears convert: inside the blocks (so not the output layer), every dim divisible by 16 on each of
    the `tp` ranks (a conservative rule: whichever dim TP splits, each shard keeps a multiple of 16)."""
    found = block_container(model, spec)
    inside = {id(m) for m in found[1].modules()} if found is not None else set()
    multiple = FP8_DIM_MULTIPLE * tp

    def convert(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or id(module) not in inside:
            return False
        out_features, in_features = module.weight.shape
        return out_features % multiple == 0 and in_features % multiple == 0

    return convert


def convert_to_float8(
    model: nn.Module, recipe: str, spec: ModelSpec | None, emulate: bool, fsdp_all_gather: bool, tp: int = 1
) -> int:
    """Swap the blocks' eligible nn.Linear for torchao's Float8Linear in place (on meta or materialised); returns
    how many were converted. Parameter names do not change, so checkpoints and exports keep plain names."""
    float8 = _torchao_float8()
    config = float8_config(recipe, emulate, fsdp_all_gather and recipe == "tensorwise")
    keep = float8_filter(model, spec, tp)
    chosen = {id(m) for fqn, m in model.named_modules() if keep(m, fqn)}
    float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: id(m) in chosen)
    return len(chosen)


def is_float8_linear(module: nn.Module) -> bool:
    """Is this a torchao Float8Linear? (False without importing torchao when nothing was converted.)"""
    return type(module).__name__ == "Float8Linear" and type(module).__module__.startswith("torchao.")


def _all_float8(module: nn.Module) -> bool:
    """Every linear in `module` is converted (a float8-cast input would reach no high-precision one)."""
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    return bool(linears) and all(is_float8_linear(m) for m in linears)


def float8_tp_styles(model: nn.Module, styles: dict) -> dict:
    """The TP plan with torchao's float8 styles for converted linears (tensorwise): Colwise/RowwiseParallel become
    Float8Colwise/Float8RowwiseParallel, which cast to float8 before the TP all-gather of the input, and a
    PrepareModuleInput in front of a module holding converted linears becomes PrepareFloat8ModuleInput, so the
    activation is cast once for all its float8 users. The layouts stay those of the plan."""
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    modules = dict(model.named_modules())
    out = dict(styles)
    for path, style in styles.items():
        module = modules.get(path)
        if module is None:
            continue
        if is_float8_linear(module) and type(style) in (ColwiseParallel, RowwiseParallel):
            cls = Float8ColwiseParallel if type(style) is ColwiseParallel else Float8RowwiseParallel
            out[path] = cls(
                input_layouts=style.input_layouts[0],
                output_layouts=style.output_layouts[0],
                use_local_output=style.use_local_output,
            )
        elif type(style) is PrepareModuleInput and _all_float8(module):
            kwargs = style.with_kwargs
            out[path] = PrepareFloat8ModuleInput(
                input_layouts=style.input_layouts,
                desired_input_layouts=style.desired_input_layouts,
                input_kwarg_layouts=style.input_kwarg_layouts if kwargs else None,
                desired_input_kwarg_layouts=style.desired_input_kwarg_layouts if kwargs else None,
                use_local_output=style.use_local_output,
            )
    return out


def uses_float8_all_gather(model: nn.Module) -> bool:
    """Does any converted linear all-gather its weight in float8 under FSDP2 (and so want its scale precomputed
    after each optimizer step)?"""
    linears: list[Any] = [m for m in model.modules() if is_float8_linear(m)]
    return any(m.config.enable_fsdp_float8_all_gather for m in linears)


def precompute_float8_scales(modules: list[nn.Module]) -> None:
    """After an optimizer step: the float8 scales of every FSDP2-sharded float8 weight of `modules` in one
    all-reduce (torchao's precompute_float8_dynamic_scale_for_fsdp), used by the next step's all-gathers."""
    float8 = _torchao_float8()
    for module in modules:
        float8.precompute_float8_dynamic_scale_for_fsdp(module)


def plain_weights(state: dict[str, Any]) -> dict[str, Any]:
    """A model state dict whose float8 all-gather weights (FSDP2 tensorwise: DTensors over torchao's
    WeightWithDynamicFloat8CastTensor) are given as DTensors over the plain high-precision shard they wrap,
    sharing its storage. DCP's async save stages such a wrapper as a tensor without data (garbage on disk, torchao
    0.18.0 + torch 2.13); the plain view saves and loads in place, and checkpoints stay free of torchao types."""
    from torch.distributed.tensor import DTensor

    out = dict(state)
    for key, value in state.items():
        local: Any = value.to_local() if isinstance(value, DTensor) else value
        if type(local).__name__ != "WeightWithDynamicFloat8CastTensor":
            continue
        inner = local._tensor
        if isinstance(value, DTensor):
            out[key] = DTensor.from_local(
                inner, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
            )
        else:
            out[key] = inner
    return out
