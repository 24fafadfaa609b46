"""`scaletrain.setup()`: bring your own model, optimizer and loop; scaletrain handles the process group, the
device, the data-parallel wrapping and the step mechanics (autocast, accumulation, loss scaling, clipping).

    import scaletrain
    job = scaletrain.setup(model, optimizer, data_parallel="fsdp", precision="bf16", grad_clip=1.0)
    loader = job.loader(dataset, global_batch_size=64)   # or your own loader: each rank feeds its own share
    for inputs, targets in loader:
        with job.autocast():
            loss = loss_fn(job.model(inputs.to(job.device)), targets.to(job.device))
        job.backward(loss)
        job.step()                                # unscale, clip, optimizer step, zero_grad
    job.save("ckpt/", extra={"data": loader.state_dict()})   # DCP, atomic; job.load("ckpt/") on any world size

Run it with `torchrun --nproc-per-node N my_script.py`, or as a plain `python my_script.py` (one rank).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import replace
from typing import Literal, cast

import torch
from torch import nn

from scaletrain.config.layout import DataParallelMode, Layout
from scaletrain.config.precisions import PrecisionName
from scaletrain.config.schema import ParallelConfig, PrecisionConfig
from scaletrain.models.spec import ModelSpec, TPWords
from scaletrain.parallel.apply import ParallelPlan, apply_parallelism
from scaletrain.parallel.blocks import ShardRule
from scaletrain.parallel.dims import build_mesh
from scaletrain.parallel.runtime import init_distributed, pick_device_type
from scaletrain.parallel.tensor_parallel import auto_tp_plan
from scaletrain.train.job import rebind_optimizer
from scaletrain.train.setup_job import SetupJob

DataParallel = Literal["auto", "none", "ddp", "fsdp", "hsdp"]
TPPlan = dict | Callable[[nn.Module], dict]


def _layout(data_parallel: DataParallel, world: int, dp_replicate: int | None, tp: int = 1) -> Layout:
    """The Layout setup()'s arguments ask for on `world` ranks (tp ranks apart, data parallelism over the rest);
    ValueError (one line naming the argument) when they cannot run there."""
    if tp < 1 or world % tp:
        raise ValueError(f"tp: {tp} does not divide the {world} ranks; pick a tp that divides the world size")
    dp = world // tp
    if data_parallel == "auto":
        data_parallel = "ddp" if dp > 1 else "none"
    if data_parallel not in ("none", "ddp", "fsdp", "hsdp"):
        raise ValueError(f"data_parallel: unknown mode {data_parallel!r}; use auto, none, ddp, fsdp or hsdp")
    mode = DataParallelMode.SINGLE if data_parallel == "none" else DataParallelMode(data_parallel)
    if mode is DataParallelMode.SINGLE:
        if dp > 1:
            raise ValueError(f"data_parallel='none' on {dp} data-parallel ranks: pick 'ddp', 'fsdp' or 'hsdp'")
        return Layout(dp_replicate=1, dp_shard=1, tp=tp)
    if mode is DataParallelMode.DDP:
        return Layout(dp_replicate=dp, dp_shard=1, tp=tp)
    if mode is DataParallelMode.FSDP:
        return Layout(dp_replicate=1, dp_shard=dp, tp=tp)
    # HSDP is refused rather than run with one rank per shard group: it would shard nothing, DDP through FSDP's
    # machinery (slower, same memory), while the user believes the model is sharded
    if not dp_replicate or dp_replicate < 2 or dp % dp_replicate or dp // dp_replicate < 2:
        raise ValueError(
            f"dp_replicate: HSDP needs a replica count >= 2 dividing the {dp} data-parallel ranks into shard "
            f"groups of >= 2 ranks (got {dp_replicate}); use data_parallel='ddp' or 'fsdp', or more ranks"
        )
    return Layout(dp_replicate=dp_replicate, dp_shard=dp // dp_replicate, tp=tp)


# setup()'s names for what a tensor-parallel refusal points at (the trainer's are its config keys)
SETUP_TP_WORDS = TPWords(
    tp="tp", tp_off="tp=1", no_plan_fix="pass your own tp_plan= or use tp=1", fsdp="data_parallel='fsdp'"
)


def _tp_styles(model: nn.Module, tp: int, tp_plan: TPPlan | None, spec: ModelSpec | None) -> dict | None:
    """The {module path pattern: ParallelStyle} plan: the user's (a dict, or a callable(model) -> dict), else the
    spec's when scaletrain knows the model, else a transformers model's own (from its base_model_tp_plan, as
    `model.hf` trains it), else one found by structure (attention and MLP linears); ValueError (one line) when
    none fits."""
    if tp == 1:  # a plan with tp=1 splits nothing: one script can pass its plan and vary tp
        return None
    if tp_plan is not None:
        plan = tp_plan(model) if callable(tp_plan) else tp_plan
        if not isinstance(plan, dict) or not plan:
            raise ValueError(
                "tp_plan: give a non-empty {module path pattern: ParallelStyle} dict or a callable returning one"
            )
        return plan
    if spec is not None:
        if spec.n_experts:  # the trainer's TP of an MoE model needs its FSDP of the experts over the TP ranks too
            raise ValueError(
                f"tp: {spec.model_name}'s experts take a piece of the tokens per TP rank only in `scaletrain "
                f"train`; use tp=1 and shard them with FSDP instead (data_parallel='fsdp')"
            )
        spec.check_tp(tp)
        return spec.tp_plan(model, False, False)
    hf = _transformers_spec(model)
    if hf is not None:
        if hf.n_experts:  # the trainer's TP of packed experts needs its FSDP of them over the TP ranks too
            raise ValueError(
                f"tp: {type(model).__name__}'s {hf.n_experts} experts are packed tensors setup() does not split "
                f"(`scaletrain train` with model.hf does); use tp=1 and shard them with FSDP instead "
                f"(data_parallel='fsdp')"
            )
        hf.check_tp(tp, dataclasses.replace(SETUP_TP_WORDS, config=f"{type(model).__name__}.config."))
        return hf.tp_plan(model, False, False)
    try:
        return auto_tp_plan(model)
    except ValueError:
        raise ValueError(
            f"tp: {type(model).__name__} is not a transformers model with a tensor-parallel plan, and no attention "
            f"or MLP linears were found in its blocks to split; pass tp_plan={{module path: ParallelStyle}} or tp=1"
        ) from None


def _transformers_spec(model: nn.Module) -> ModelSpec | None:
    """The HF spec of a transformers model (its own base_model_tp_plan, found layers), None for any other model.
    transformers is looked up, not imported: a model of it means it is loaded already."""
    import sys

    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return None
    from scaletrain.models.vision.spec import VisionSpec, image_classifier_types

    if type(model).__name__ in image_classifier_types().values():  # a ViT, ResNet, ConvNeXt ... classifier
        return VisionSpec.of_model(model)
    from scaletrain.models.vlm.spec import SUPPORTED, VLMSpec

    if type(model).__name__ in SUPPORTED:  # a LLaVA-style vision-language model
        return VLMSpec.of_model(model)
    from scaletrain.models.hf.spec import HFSpec

    return HFSpec.of_model(model)


def setup(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    data_parallel: DataParallel = "auto",
    precision: PrecisionName = "fp32",
    dp_replicate: int | None = None,
    reshard_after_forward: bool = True,
    shard: ShardRule | None = None,
    tp: int = 1,
    tp_plan: TPPlan | None = None,
    spec: ModelSpec | None = None,
    fsdp_accumulate: Literal["sharded", "unsharded"] = "sharded",
    grad_clip: float = 0.0,
    device: Literal["auto", "cpu", "cuda"] = "auto",
    timeout_s: float = 600.0,
) -> SetupJob:
    """Join the process group, move and lay out `model` (tensor parallel, then data parallel), return a Job.

    data_parallel: 'auto' (DDP on several data-parallel ranks, nothing on one), 'ddp', 'fsdp' (FSDP2),
    'hsdp' (FSDP2 inside groups of dp/dp_replicate ranks, replicated across dp_replicate groups; each group >= 2).
    shard: which modules FSDP2 shards as units: module classes or a predicate(name, module) -> bool; None: the
    model's blocks (its largest ModuleList / ModuleDict). Tied parameters stay with the root.
    tp: tensor-parallel degree (dividing the world size; data parallelism runs over world/tp ranks). tp_plan:
    {module path pattern: torch ParallelStyle} or a callable(model) -> that dict; None: the plan of `spec` (a
    scaletrain ModelSpec of this model), else a transformers model's own (its config's base_model_tp_plan, as
    `model.hf` trains it; ValueError when it has none or it cannot be split), else one found by structure.
    precision: compute dtype; master weights and optimizer states stay fp32; fp16 adds loss scaling.
    fsdp_accumulate: under FSDP/HSDP, 'sharded' reduce-scatters even inside accumulate(sync=False), keeping
    gradients sharded (memory / ranks); 'unsharded' holds whole gradients until sync=True.
    grad_clip: max global L2 norm of the gradients (0: no clipping). Every rank must build the same initial weights
    (seed before building the model). Returns job with .model, .optimizer, .device, .rank, .world_size, .dp_rank,
    .autocast(), .accumulate(sync), .backward(loss), .step(), .save(dir, extra), .load(dir), .loader(dataset, ...).
    """
    rt = init_distributed(pick_device_type(device), timeout_s)
    layout = replace(_layout(data_parallel, rt.world_size, dp_replicate, tp), precision=precision)
    mesh = build_mesh(layout, rt.device.type)
    names = {id(p): n for n, p in model.named_parameters()}
    # how each parallelism runs: the [parallel] section a job config would give (its degrees are the layout's)
    parallel = ParallelConfig(
        dp_replicate=layout.dp_replicate,
        dp_shard=layout.dp_shard,
        tp=layout.tp,
        fsdp_reshard_after_forward=reshard_after_forward,
        fsdp_accumulate=fsdp_accumulate,
    )
    styles = _tp_styles(model, tp, tp_plan, spec)
    plan = ParallelPlan(layout, parallel, PrecisionConfig(dtype=precision), spec, shard=shard, tp_styles=styles)
    laid_out = apply_parallelism(model, plan, mesh, rt.device)
    if any(id(p) not in names for p in laid_out.module.parameters()):
        optimizer = rebind_optimizer(optimizer, names, laid_out.module)
    job = cast(SetupJob, SetupJob.for_model(laid_out, optimizer, rt, grad_clip))
    job.model_spec = spec if spec is not None else _transformers_spec(model)  # `ckpt export --format hf` needs it
    return job
