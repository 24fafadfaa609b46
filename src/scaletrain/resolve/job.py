"""Job resolution: a config checked against a world size, before any rank starts, into the model spec and the
Layout the trainer runs. The command line, the launchers, the planner's `--plan auto` and the trainer all resolve a
job here, so what is refused at launch is exactly what would fail in the ranks."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from scaletrain.config.layout import Layout
from scaletrain.config.schema import JobConfig
from scaletrain.models.registry import model_spec
from scaletrain.models.spec import ModelSpec
from scaletrain.monitor.sinks import check_trackers
from scaletrain.resolve.checks import check_embedding_memory, check_hf_init, check_layout, pipeline_microbatches
from scaletrain.resolve.device import settle_device_defaults
from scaletrain.tasks import task_for


@dataclass(frozen=True)
class ResolvedJob:
    """A job checked against a world size: the model's spec and the Layout it runs (degrees, micro-batch x
    accumulation per data-parallel rank, activation checkpointing, compute dtype, pipeline schedule)."""

    spec: ModelSpec
    layout: Layout


def check_lora_job(cfg: JobConfig, spec: ModelSpec, degrees: Layout) -> None:
    """ValueError (one line) for LoRA settings this model or layout cannot train."""
    from scaletrain.models.lora import check_lora

    adapted = check_lora(cfg.lora, spec)
    if cfg.lora.quantize != "none" and cfg.lora.rank:
        from scaletrain.models.lora import check_quantize

        if degrees.tp > 1:  # a rowwise split cuts NF4's blocks of a row: torchao's NF4 splits along rows only
            raise ValueError(
                "lora.quantize: a 4-bit base is not split by tensor parallelism; use parallel.tp=1 (FSDP shards it)"
            )
        if cfg.parallel.cpu_offload:
            raise ValueError("lora.quantize: a 4-bit base is not offloaded to the CPU; use parallel.cpu_offload=false")
        check_quantize(cfg.lora, adapted, degrees.dp_shard if degrees.mode.sharded else 1)
    if degrees.tp > 1 and cfg.lora.dropout:  # each TP rank would draw its own mask on the whole input
        raise ValueError("lora.dropout: adapter dropout under tensor parallelism is not supported; use lora.dropout=0")
    if degrees.cp > 1:
        raise ValueError("lora.rank: LoRA under context parallelism is not supported yet; use parallel.cp=1")
    if cfg.precision.fp8 != "none":
        raise ValueError("lora.rank: LoRA on float8 linears is not supported; use precision.fp8='none'")
    if cfg.checkpoint.init_from_hf:
        raise ValueError(
            "checkpoint.init_from_hf: not supported with LoRA yet; start from model.hf=FOLDER (an HF model folder)"
        )


def resolve_job(cfg: JobConfig, world_size: int) -> ResolvedJob:
    """Check the config against a world size; raise ValueError whose message names the field and the fix.
    precision.dtype / parallel.compile "auto" are checked as they resolve on this host (settle_device_defaults)."""
    cfg = settle_device_defaults(cfg)
    check_trackers(cfg.monitor)  # each tracker's library installed (the trackers extra), its settings usable
    spec = model_spec(cfg.model)
    task = task_for(cfg.task)
    task.check(cfg, spec)  # what the task needs of the model (vocabulary, sequence length)
    if cfg.checkpoint.init_from_hf and not Path(cfg.checkpoint.init_from_hf).is_dir():
        raise ValueError(
            f"checkpoint.init_from_hf: {cfg.checkpoint.init_from_hf!r} is not a folder; point it at a "
            f"Hugging Face model folder with *.safetensors and config.json"
        )
    if cfg.checkpoint.init_from_hf:
        check_hf_init(Path(cfg.checkpoint.init_from_hf), spec)
    degrees = Layout.from_degrees(cfg.parallel, world_size)
    gb, dp = cfg.train.global_batch_size, degrees.dp
    if gb % dp:
        raise ValueError(f"train.global_batch_size: {gb} is not divisible by the data-parallel degree {dp}")
    micro = cfg.train.micro_batch_size or gb // dp
    if gb % (micro * dp):
        raise ValueError(
            f"train.micro_batch_size: {gb} sequences per step do not split into micro-batches of "
            f"{micro} on {dp} data-parallel ranks; pick a divisor of {gb // dp}"
        )
    check_layout(cfg, spec, degrees)
    if cfg.lora.rank:
        check_lora_job(cfg, spec, degrees)
    piped = degrees.pp > 1
    if piped:
        micro = gb // dp // pipeline_microbatches(cfg, degrees)
    task.check_data(cfg, spec)  # every dataset opens and fits the model, before any rank starts
    spec = task.bind_data(cfg, spec)  # what the data decides of the model (a classifier's classes)
    layout = replace(
        degrees,
        micro_batch=micro,
        accumulation=gb // (micro * dp),
        ac=cfg.parallel.activation_checkpoint,
        precision=str(cfg.precision.dtype),
        schedule=cfg.parallel.pp_schedule if piped else "none",
        virtual_stages=cfg.parallel.stages_per_rank if piped else 1,
    )
    check_embedding_memory(cfg, spec, layout, world_size)  # sized by the data (bind_data)
    if cfg.launch.fault_tolerance == "replicas" and degrees.dp_replicate > 1:
        check_fewer_replicas(cfg, degrees)
    return ResolvedJob(spec=spec, layout=layout)


def check_fewer_replicas(cfg: JobConfig, degrees: Layout) -> None:
    """launch.fault_tolerance=replicas: the job must also resolve on each smaller count of its replicas, which train
    on while one is refilled (the same global batch over fewer data-parallel ranks)."""
    alone = cfg.model_copy(update={"launch": cfg.launch.model_copy(update={"fault_tolerance": "none"})})
    for replicas in range(degrees.dp_replicate - 1, 0, -1):
        try:
            resolve_job(alone.with_replicas(replicas), degrees.replica_ranks * replicas)
        except ValueError as e:
            raise ValueError(
                f"launch.fault_tolerance: replicas: on {replicas} of the {degrees.dp_replicate} replicas the job "
                f"does not resolve ({e})"
            ) from None
