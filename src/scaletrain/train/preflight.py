"""Everything about a job that can be checked before a process is started, with one-line errors."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from scaletrain.config.precisions import precision, resolve_dtype
from scaletrain.config.schedules import pipeline_schedule
from scaletrain.config.schema import JobConfig
from scaletrain.data.checks import token_id_range  # noqa: F401  (token_id_range: moved there)
from scaletrain.models.registry import model_spec
from scaletrain.models.spec import ModelSpec
from scaletrain.parallel.dims import ParallelDims
from scaletrain.parallel.rank_env import under_external_launcher  # noqa: F401  (the command asks preflight)
from scaletrain.tasks import task_for


@dataclass(frozen=True)
class ResolvedJob:
    spec: ModelSpec
    dims: ParallelDims
    micro_batch: int
    accumulation: int


def settle_device_defaults(cfg: JobConfig, device_type: str | None = None) -> JobConfig:
    """The job with precision.dtype=auto and parallel.compile=auto decided for the device its ranks run on
    (`device_type`, default: run.device on this host). dtype: config/precisions.py resolve_dtype. compile: off
    on a CPU and where the pipeline schedule cannot be compiled; on with fp8 on a GPU (eager fp8 ran at half the
    speed of bf16 on an H200: BENCHMARKS.md); otherwise it stays "auto" and the loop decides after timing the
    first steps (parallel/compile.py CompileProbe). ValueError (one line) for fp8 with compile=false on a GPU."""
    from scaletrain.parallel.runtime import pick_device_type

    device = device_type or pick_device_type(cfg.run.device)
    dtype = resolve_dtype(cfg.precision.dtype, cfg.precision.fp8, device, _bf16_supported(device))
    compile_ = cfg.parallel.compile
    fp8_on_gpu = cfg.precision.fp8 != "none" and device == "cuda"
    if compile_ is False and fp8_on_gpu:
        raise ValueError(
            f"precision.fp8: {cfg.precision.fp8} without compile runs at about half the speed of plain bf16 on a "
            f"GPU (its casts and scales run as separate kernels); set parallel.compile=true (or auto) or "
            f"precision.fp8=none"
        )
    split_backward = cfg.parallel.pp > 1 and pipeline_schedule(cfg.parallel.pp_schedule).split_backward
    if fp8_on_gpu and split_backward:
        raise ValueError(
            f"precision.fp8: {cfg.precision.fp8} needs compiled blocks on a GPU, which {cfg.parallel.pp_schedule} "
            f"(backward split in two) cannot have; use parallel.pp_schedule=1F1B or Interleaved1F1B, or precision.fp8=none"
        )
    if compile_ == "auto":
        if device != "cuda" or split_backward:
            compile_ = False
        elif fp8_on_gpu:
            compile_ = True
    if dtype == cfg.precision.dtype and compile_ == cfg.parallel.compile:
        return cfg
    return cfg.model_copy(
        update={
            "precision": cfg.precision.model_copy(update={"dtype": dtype}),
            "parallel": cfg.parallel.model_copy(update={"compile": compile_}),
        }
    )


def _bf16_supported(device_type: str) -> bool:
    if device_type != "cuda":
        return False
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)


def resolve_job(cfg: JobConfig, world_size: int) -> ResolvedJob:
    """Check the config against a world size; raise ValueError whose message names the field and the fix.
    precision.dtype / parallel.compile "auto" are checked as they resolve on this host (settle_device_defaults)."""
    cfg = settle_device_defaults(cfg)
    spec = model_spec(cfg.model)
    task = task_for(cfg.task)
    task.check(cfg, spec)
    if cfg.checkpoint.init_from_hf and not Path(cfg.checkpoint.init_from_hf).is_dir():
        raise ValueError(
            f"checkpoint.init_from_hf: {cfg.checkpoint.init_from_hf!r} is not a folder; point it at a "
            f"Hugging Face model folder with *.safetensors and config.json"
        )
    if cfg.checkpoint.init_from_hf:
        check_hf_init(Path(cfg.checkpoint.init_from_hf), spec)
    dims = ParallelDims.resolve(cfg.parallel, world_size)
    gb = cfg.train.global_batch_size
    if gb % dims.dp:
        raise ValueError(f"train.global_batch_size: {gb} is not divisible by the data-parallel degree {dims.dp}")
    micro = cfg.train.micro_batch_size or gb // dims.dp
    if gb % (micro * dims.dp):
        raise ValueError(
            f"train.micro_batch_size: {gb} sequences per step do not split into micro-batches of "
            f"{micro} on {dims.dp} data-parallel ranks; pick a divisor of {gb // dims.dp}"
        )
    check_layout(cfg, spec, dims)
    if dims.pp > 1:
        micro = gb // dims.dp // pipeline_microbatches(cfg, dims)
    task.check_data(cfg, spec)
    return ResolvedJob(spec=spec, dims=dims, micro_batch=micro, accumulation=gb // (micro * dims.dp))


def check_hf_init(folder: Path, spec: ModelSpec) -> None:
    """checkpoint.init_from_hf refused before launch (one line) when the folder's model is not the configured one:
    another architecture, shape, vocabulary or rotary setting."""
    import json

    if spec.hf is None:
        raise ValueError(f"checkpoint.init_from_hf: the {spec.family} model family has no Hugging Face counterpart")
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"checkpoint.init_from_hf: no *.safetensors in {str(folder)!r}")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"checkpoint.init_from_hf: {str(folder)!r} has no config.json to check the model against")
    try:
        hf_config = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"checkpoint.init_from_hf: {cfg_path} is not valid JSON ({e})") from None
    spec.hf.check_config(hf_config)


def check_layout(cfg: JobConfig, spec: ModelSpec, dims: ParallelDims) -> None:
    """Layouts that cannot run, refused before launch with one line naming the field: TP degrees that do not
    split the heads or matmuls, more pipeline stages than layers, combinations torch does not support."""
    p = cfg.parallel
    if p.cpu_offload and dims.mode not in ("fsdp", "hsdp"):
        raise ValueError(
            f"parallel.cpu_offload: offloads FSDP2's shards, but this layout is {dims.mode} (dp_shard="
            f"{dims.dp_shard}); shard with parallel.dp_shard > 1 or set parallel.cpu_offload=false"
        )
    if p.cpu_offload and dims.pp > 1:
        raise ValueError(
            "parallel.cpu_offload: not combined with pipeline parallelism (torch's pipeline schedules keep stages "
            "unsharded on the device); use parallel.pp=1 or parallel.cpu_offload=false"
        )
    check_fp8(cfg)
    if dims.tp > 1:
        if dims.mode == "ddp":
            raise ValueError(
                f"parallel.tp: DDP (dp_replicate={dims.dp_replicate}, dp_shard=1) does not combine "
                f"with tensor parallelism; shard instead (parallel.dp_shard={dims.dp_replicate} "
                f"parallel.dp_replicate=1) or use HSDP"
            )
        spec.check_tp(dims.tp)
        if p.sequence_parallel and cfg.data.seq_len % dims.tp:
            raise ValueError(
                f"parallel.sequence_parallel: data.seq_len={cfg.data.seq_len} is not divisible by parallel.tp={dims.tp}"
            )
        if p.sequence_parallel and p.tp_plan == "auto":
            raise ValueError(
                "parallel.sequence_parallel: needs parallel.tp_plan=model (the auto plan shards only the linears)"
            )
    if dims.cp > 1:
        check_context_parallel(cfg, spec, dims)
    if dims.pp > 1:
        spec.check_pp(dims.pp)
        stages = dims.pp * p.stages_per_rank
        if stages > spec.n_blocks:
            raise ValueError(
                f"parallel.pp: {dims.pp} x {p.stages_per_rank} stage(s) per rank = {stages} pipeline "
                f"stages, but the model has only {spec.n_blocks} layers; lower parallel.pp"
            )
        if precision(cfg.precision.dtype).loss_scaling:
            raise ValueError(
                f"precision.dtype: {cfg.precision.dtype} loss scaling does not run inside a pipeline "
                f"schedule; use bf16 with parallel.pp > 1"
            )
        pipeline_microbatches(cfg, dims)


def check_context_parallel(cfg: JobConfig, spec: ModelSpec, dims: ParallelDims) -> None:
    """cp > 1 needs a model whose attention can be split, sequences that cut into 2·cp equal chunks (a head and a
    tail chunk per rank), and an attention method this device runs."""
    from scaletrain.parallel.context_parallel import pick_cp_method
    from scaletrain.parallel.runtime import pick_device_type

    if not spec.supports_cp:
        raise ValueError(
            f"parallel.cp: the {spec.family} family's attention cannot be split over ranks; use parallel.cp=1"
        )
    seq = cfg.data.seq_len
    if seq % (2 * dims.cp):
        raise ValueError(
            f"parallel.cp: data.seq_len={seq} is not divisible by 2 x parallel.cp = {2 * dims.cp} (each rank "
            f"takes a head and a tail chunk); pick a data.seq_len that is a multiple of {2 * dims.cp}"
        )
    if cfg.parallel.sequence_parallel and (seq // dims.cp) % dims.tp:
        raise ValueError(
            f"parallel.sequence_parallel: the {seq // dims.cp} tokens per cp rank are not divisible by "
            f"parallel.tp={dims.tp}; pick a data.seq_len that is a multiple of {2 * dims.cp * dims.tp}"
        )
    pick_cp_method(cfg.parallel.cp_method, pick_device_type(cfg.run.device), spec)


def check_fp8(cfg: JobConfig) -> None:
    """fp8 runs on top of bf16 compute only: fp16's loss scaling would scale the gradients fp8 casts with its own
    dynamic scales (torchao does not support the pair), and fp32 compute around fp8 matmuls is a combination no
    fp8 recipe (torchao, torchtitan) trains with. Compile is allowed everywhere: inductor compiles the emulated
    float8 blocks on CPU too (torch 2.13, torchao 0.18.0)."""
    fp8 = cfg.precision.fp8
    if fp8 == "none":
        return
    if cfg.precision.dtype != "bf16":
        raise ValueError(
            f"precision.fp8: {fp8} runs on top of bf16 compute, not {cfg.precision.dtype}; "
            f"set precision.dtype=bf16 or precision.fp8=none"
        )
    if importlib.util.find_spec("torchao") is None:
        raise ValueError(
            f"precision.fp8: {fp8} trains through torchao, which is not installed; "
            f"pip install 'scaletrain[fp8]' or set precision.fp8=none"
        )


def pipeline_microbatches(cfg: JobConfig, dims: ParallelDims) -> int:
    """Micro-batches per step of each pipeline: parallel.pp_microbatches, else one per train.micro_batch_size,
    else the number of stages (the fewest that fill every schedule). ValueError names the field."""
    p = cfg.parallel
    per_rank = cfg.train.global_batch_size // dims.dp
    stages = dims.pp * p.stages_per_rank
    if p.pp_microbatches is not None:
        m = p.pp_microbatches
        if cfg.train.micro_batch_size and cfg.train.micro_batch_size * m != per_rank:
            raise ValueError(
                f"parallel.pp_microbatches: {m} micro-batches of train.micro_batch_size="
                f"{cfg.train.micro_batch_size} are not the {per_rank} sequences per data-parallel "
                f"rank; set only one of them"
            )
    elif cfg.train.micro_batch_size:
        m = per_rank // cfg.train.micro_batch_size
    else:
        m = stages
    if per_rank % m:
        raise ValueError(
            f"parallel.pp_microbatches: {per_rank} sequences per data-parallel rank do not split into "
            f"{m} micro-batches; set parallel.pp_microbatches to a divisor of {per_rank}"
        )
    schedule = pipeline_schedule(p.pp_schedule)
    if schedule.microbatch_per_stage and m < stages:
        raise ValueError(
            f"parallel.pp_microbatches: {p.pp_schedule} needs at least one micro-batch per stage ({stages}), got {m}"
        )
    rounds = max(1, m // dims.pp)
    if schedule.microbatch_rounds and m % rounds:
        raise ValueError(
            f"parallel.pp_microbatches: {p.pp_schedule} needs a multiple of {rounds} micro-batches "
            f"(rounds of pp={dims.pp}), got {m}"
        )
    return m


def default_nproc(device: str) -> int:
    """Ranks for this host when launch.nproc_per_node is 0: every local GPU, or 2 CPU ranks."""
    import torch

    if device in ("auto", "cuda") and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 2
