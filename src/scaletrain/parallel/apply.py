"""Applying a layout to a model, in one fixed order:
FP8 conversion → pipeline split → context parallel → sharded embedding tables → expert parallel → tensor (+ sequence)
parallel → activation checkpointing → compile → FSDP2 / DDP.

Each step works on the meta-device model; it is materialised at the right moment: after FSDP sharding (each rank
allocates only its shard), before DDP (which broadcasts rank 0's weights at construction). TP before FSDP makes
FSDP shard the TP shards (2-D DTensors); AC and compile wrap whole blocks before FSDP so that FSDP still sees one
unit per block. FP8 conversion comes first (as in torchtitan) so TP and FSDP shard the float8 linears' weights and
pick their float8 styles and all-gathers (parallel/float8.py). A recommender's embedding tables are split over the
data-parallel ranks before FSDP / DDP (parallel/embedding.py), which then leave them out.

What to apply is one ParallelPlan: the Layout's degrees (config/layout.py), the job's [parallel] and [precision]
sections for how each parallelism runs, and the model's spec. The trainer builds it from its resolved job
(train/trainer.py build_model), `scaletrain.setup()` from its arguments (api.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from scaletrain.config.layout import DataParallelMode, Layout
from scaletrain.config.schema import ParallelConfig, PrecisionConfig
from scaletrain.models.spec import ModelSpec
from scaletrain.models.stages import split_layers
from scaletrain.parallel.activation_checkpoint import apply_activation_checkpointing
from scaletrain.parallel.compile import apply_compile
from scaletrain.parallel.blocks import ShardRule
from scaletrain.parallel.context_parallel import ContextParallel, apply_context_parallel, pick_cp_method
from scaletrain.parallel.data_parallel import apply_ddp, apply_fsdp
from scaletrain.parallel.pipeline import Pipeline, PipelinedModel, build_pipeline, shared_copies, stages_of_rank
from scaletrain.parallel.tensor_parallel import TPOptions, apply_tensor_parallel


@dataclass(frozen=True)
class ParallelPlan:
    """What apply_parallelism lays a model out by: the layout's degrees, how each parallelism runs (the job's
    [parallel] section; its degrees are the layout's), the [precision] section, and the model's spec (None: a model
    read by structure, from setup(), which cannot be pipelined or context-parallel)."""

    layout: Layout
    parallel: ParallelConfig
    precision: PrecisionConfig
    spec: ModelSpec | None = None
    seq_len: int | None = None  # tokens per sample: the context-parallel split and the pipeline's stage balance
    shard: ShardRule | None = None  # setup(): the modules FSDP2 shards as units (None: the spec's or found blocks)
    tp_styles: dict | None = None  # setup(): a {module path: ParallelStyle} plan used instead of parallel.tp_plan

    @property
    def microbatches(self) -> int:
        """Pipeline micro-batches per step (pp > 1): the layout's accumulation."""
        return self.layout.accumulation


@dataclass
class ParallelModel:
    """What apply_parallelism built: the module to train, the plan and mesh it was laid out by, and what the
    training step must know to run it."""

    module: nn.Module  # the wrapped model; with pp > 1 a PipelinedModel of this rank's stages
    plan: ParallelPlan
    mesh: Any  # the DeviceMesh of plan.layout (parallel/dims.py build_mesh); None on one rank
    pipeline: Pipeline | None = None  # the schedule that runs this rank's stages (pp > 1)
    loss_parallel: bool = False  # logits come vocabulary-sharded: loss and backward under loss_parallel()
    context: ContextParallel | None = None  # cp > 1: this rank's part of every sequence (inputs/targets sharded)
    # run after every optimizer step (fp8 under FSDP2: precompute the float8 weight scales for the next all-gather;
    # the spec's own step hook, e.g. an MoE router's bias update)
    after_optimizer_step: Callable[[], None] | None = None
    # metrics of the last optimizer step the spec's hook returned (an MoE model's expert load), for the log
    step_metrics: dict[str, float] = field(default_factory=dict)

    @property
    def stages(self) -> list[nn.Module]:
        """This rank's pipeline stage modules (empty without a pipeline)."""
        return list(cast(PipelinedModel, self.module)) if self.pipeline is not None else []

    def compile_blocks(self, spec: ModelSpec | None = None) -> int:
        """Compile the blocks of the model (of each stage with a pipeline) in place, after it was laid out
        (parallel.compile=auto decided it pays, parallel/compile.py); returns how many were compiled."""
        from torch.nn.parallel import DistributedDataParallel

        compiled = 0
        for part in self.stages or [self.module]:
            if isinstance(part, DistributedDataParallel):
                part = part.module
            compiled += apply_compile(part, spec)
        return compiled


def _on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _materialize(model: nn.Module, device: torch.device, init_fn: Callable[[nn.Module], None] | None) -> None:
    if _on_meta(model):
        if init_fn is None:
            raise ValueError("model is on the meta device but no init function was given to fill its weights")
        model.to_empty(device=device)
        init_fn(model)
    else:
        model.to(device)


def _data_parallel_mesh(mesh):
    """The 1-D mesh of every data-parallel rank (dp_replicate x dp_shard, flattened under HSDP)."""
    dims = tuple(n for n in ("dp_replicate", "dp_shard") if n in (mesh.mesh_dim_names or ()))
    if len(dims) == 1:
        return mesh[dims[0]]
    return mesh[dims]._flatten("dp")


def _parallelize(
    model: nn.Module,
    plan: ParallelPlan,
    mesh,
    device: torch.device,
    init_fn: Callable[[nn.Module], None] | None,
    whole_model: bool = True,
) -> tuple[nn.Module, bool]:
    """TP → AC → compile → FSDP/DDP on one model (or one pipeline stage of it, whole_model=False: the plan's own
    FSDP units and TP styles are for a whole model); returns it and whether its logits are vocabulary-sharded
    (loss parallel)."""
    layout, parallel, precision, spec = plan.layout, plan.parallel, plan.precision, plan.spec
    shard, tp_styles = (plan.shard, plan.tp_styles) if whole_model else (None, None)
    loss_parallel = False
    tables = spec.embedding_tables() if spec is not None and mesh is not None else None
    if tables is not None and parallel.embedding_sharding != "none":
        from scaletrain.parallel.embedding import shard_embedding_tables

        shard_embedding_tables(model, tables, _data_parallel_mesh(mesh), parallel.embedding_sharding,
                               layout.grad_average)  # fmt: skip
    if layout.ep > 1 and spec is not None:
        from scaletrain.parallel.expert import apply_expert_parallel

        apply_expert_parallel(model, spec, mesh["ep"])
    if layout.tp > 1:
        loss_parallel = (
            parallel.loss_parallel
            and layout.pp == 1
            and parallel.tp_plan == "model"
            and tp_styles is None
            and spec is not None
            and spec.has_output(model)
        )
        styles = tp_styles if tp_styles is not None else parallel.tp_plan
        # float8 styles move float8 tensors through TP collectives, which gloo cannot carry ("Invalid scalar
        # type", torch 2.13) once sequence parallelism all-gathers activations: plain styles on CPU ranks there
        float8_styles = precision.fp8 == "tensorwise" and not (parallel.sequence_parallel and device.type != "cuda")
        opts = TPOptions(parallel.sequence_parallel, loss_parallel, float8=float8_styles)
        apply_tensor_parallel(model, mesh["tp"], opts, styles, spec)
    apply_activation_checkpointing(
        model, parallel.activation_checkpoint, parallel.ac_selective, parallel.ac_every, spec
    )
    if parallel.compile is True:  # "auto" compiles later, if at all (parallel/compile.py CompileProbe)
        apply_compile(model, spec)
    if layout.mode.sharded:
        model = apply_fsdp(
            model,
            mesh,
            layout,
            precision.dtype,
            precision.reduce_dtype,
            parallel.fsdp_reshard_after_forward,
            spec,
            shard,
            parallel.cpu_offload,
        )
        if parallel.cpu_offload:  # the shards live in host memory; buffers (rotary tables) still go to the device
            _materialize(model, torch.device("cpu"), init_fn)
            for buf in model.buffers():
                buf.data = buf.data.to(device)
        else:
            _materialize(model, device, init_fn)
        return model, loss_parallel
    _materialize(model, device, init_fn)
    if layout.mode is DataParallelMode.DDP:
        return apply_ddp(model, mesh, device, parallel.ddp_bucket_cap_mb), loss_parallel
    return model, loss_parallel


def _apply_float8(
    model: nn.Module, plan: ParallelPlan, device: torch.device
) -> Callable[[list[nn.Module]], None] | None:
    """Convert the blocks' linears to float8 (precision.fp8) on the whole model, before the pipeline cut; returns
    what must run after each optimizer step (the float8 all-gather's scale precompute), if anything."""
    fp8 = plan.precision.fp8
    if fp8 == "none":
        return None
    from scaletrain.parallel.float8 import (
        check_float8_device,
        convert_to_float8,
        precompute_float8_scales,
        uses_float8_all_gather,
    )

    check_float8_device(fp8, device.type)
    fsdp, tp = plan.layout.mode.sharded, plan.layout.tp
    convert_to_float8(model, fp8, plan.spec, emulate=device.type != "cuda", fsdp_all_gather=fsdp, tp=tp)
    return precompute_float8_scales if uses_float8_all_gather(model) else None


def _bind(
    hook: Callable[[list[nn.Module]], None] | None, spec: ModelSpec | None, modules: list[nn.Module], metrics: dict
) -> Callable[[], None] | None:
    """What runs after each optimizer step: `hook` on the model's parts, then the spec's own step hook (whose
    metrics replace `metrics`' content); None when there is nothing to run."""
    spec_hook = spec is not None and type(spec).after_optimizer_step is not ModelSpec.after_optimizer_step
    if hook is None and not spec_hook:
        return None

    def run() -> None:
        if hook is not None:
            hook(modules)
        if spec is not None and spec_hook:
            metrics.clear()
            metrics.update(spec.after_optimizer_step(modules))

    return run


def apply_parallelism(
    model: nn.Module,
    plan: ParallelPlan,
    mesh,
    device: torch.device,
    init_fn: Callable[[nn.Module], None] | None = None,
) -> ParallelModel:
    """The model wrapped for `plan` on `mesh` (build_mesh of plan.layout), its weights on `device` (filled by
    init_fn if on meta).

    plan.spec answers which modules are the blocks, the TP plan and the pipeline cut; a model without one (setup())
    is read by structure and cannot be pipelined. With pp > 1 the module is a PipelinedModel of this rank's stages,
    run by the returned pipeline over plan.microbatches micro-batches per step; the stage split is balanced by the
    cost of plan.seq_len-token samples.
    """
    layout, parallel, spec = plan.layout, plan.parallel, plan.spec

    def context_parallel(part: nn.Module) -> ContextParallel | None:
        if layout.cp == 1:
            return None
        if spec is None or plan.seq_len is None:
            raise ValueError("parallel.cp: context parallelism needs a model spec and data.seq_len; use parallel.cp=1")
        method = pick_cp_method(parallel.cp_method, device.type, spec)
        return apply_context_parallel(part, spec, mesh["cp"], device, method, plan.seq_len)

    after_step = _apply_float8(model, plan, device)
    if layout.pp == 1:
        context = context_parallel(model)
        module, loss_parallel = _parallelize(model, plan, mesh, device, init_fn)
        built = ParallelModel(module, plan, mesh, None, loss_parallel, context)
        built.after_optimizer_step = _bind(after_step, spec, [module], built.step_metrics)
        return built
    if spec is None:
        raise ValueError("parallel.pp: pipeline parallelism needs a model spec to cut stages; use parallel.pp=1")
    n_stages = layout.pp * parallel.stages_per_rank
    bounds = split_layers(spec.layer_costs(plan.seq_len or spec.max_seq_len or 0), n_stages, parallel.pp_balance)
    pp_rank = mesh["pp"].get_local_rank()
    stage_ids = stages_of_rank(pp_rank, layout.pp, n_stages, parallel.pp_schedule)
    stages = [spec.stage(model, s, n_stages, bounds[s]) for s in stage_ids]
    contexts = [context_parallel(stage) for stage in stages]
    parts = [_parallelize(stage, plan, mesh, device, init_fn, whole_model=False)[0] for stage in stages]
    pipeline = build_pipeline(
        parts, stage_ids, n_stages, mesh["pp"], device, parallel.pp_schedule, plan.microbatches, bounds
    )
    shared = spec.shared_across_stages()
    if shared:
        pipeline.shared = shared_copies(parts, stage_ids, shared, n_stages, mesh, parallel.pp_schedule)
    pipelined = PipelinedModel(parts, stage_ids)
    built = ParallelModel(pipelined, plan, mesh, pipeline, False, contexts[0])
    built.after_optimizer_step = _bind(after_step, spec, parts, built.step_metrics)
    return built
