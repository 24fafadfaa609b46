"""Everything about a job that can be checked before a process is started, with one-line errors."""

from __future__ import annotations

import importlib.util
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scaletrain.config.precisions import precision
from scaletrain.config.schedules import pipeline_schedule
from scaletrain.config.schema import JobConfig
from scaletrain.models.registry import model_spec
from scaletrain.models.spec import ModelSpec
from scaletrain.parallel.dims import ParallelDims
from scaletrain.parallel.rank_env import under_external_launcher  # noqa: F401  (the command asks preflight)


@dataclass(frozen=True)
class ResolvedJob:
    spec: ModelSpec
    dims: ParallelDims
    micro_batch: int
    accumulation: int


TOKEN_SCAN_CHUNK = 1 << 24  # token ids per slice of the memory map: 32-64 MiB resident at a time


def token_id_range(path: str | Path, dtype: str) -> tuple[int, int, int, int]:
    """(smallest id, its index, largest id, its index) of a flat token file, read through a memory map in
    TOKEN_SCAN_CHUNK slices so memory stays bounded; 100M uint16 tokens take ~0.3 s from the page cache, ~0.9 s
    from disk (2 shared cores)."""
    data = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    lo = hi = (int(data[0]), 0)
    for start in range(0, len(data), TOKEN_SCAN_CHUNK):
        part = data[start : start + TOKEN_SCAN_CHUNK]
        i, j = int(part.argmin()), int(part.argmax())
        if part[i] < lo[0]:
            lo = (int(part[i]), start + i)
        if part[j] > hi[0]:
            hi = (int(part[j]), start + j)
    return lo[0], lo[1], hi[0], hi[1]


def _stream_tokens(cfg: JobConfig, vocab_size: int) -> int:
    """Tokens in the configured stream; a token file is also checked to hold only ids the model can embed."""
    d = cfg.data
    if d.source == "synthetic":
        return d.synthetic_tokens
    if d.source == "tokens":
        p = Path(d.path or "")
        if not p.is_file():
            raise ValueError(f"data.path: {d.path!r} does not exist; point it at a flat file of token ids")
        size = p.stat().st_size
        dtype = np.dtype(d.token_dtype)
        if size % dtype.itemsize:
            raise ValueError(
                f"data.path: {d.path!r} has {size} bytes, not a whole number of "
                f"{d.token_dtype} tokens; check data.token_dtype"
            )
        # unsigned ids below the vocabulary by construction need no scan (uint16 with a vocabulary >= 65,536)
        if size and (dtype.kind != "u" or np.iinfo(dtype).max >= vocab_size):
            lo, lo_at, hi, hi_at = token_id_range(p, d.token_dtype)
            if lo < 0:
                raise ValueError(
                    f"data.path: token id {lo} at position {lo_at} of {d.path!r} is negative; "
                    f"check data.token_dtype (the file may hold unsigned ids)"
                )
            if hi >= vocab_size:
                raise ValueError(
                    f"data.path: token id {hi} at position {hi_at} of {d.path!r} is >= the model's "
                    f"vocab_size {vocab_size}; check data.token_dtype or set model.vocab_size={hi + 1}"
                )
        return size // dtype.itemsize
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if not stdlib.is_dir():
        raise ValueError(f"data.source: this Python's stdlib folder {stdlib} is missing; use data.source=synthetic")
    return d.max_bytes  # the stdlib of any CPython is far larger than the default max_bytes


def resolve_job(cfg: JobConfig, world_size: int) -> ResolvedJob:
    """Check the config against a world size; raise ValueError whose message names the field and the fix."""
    spec = model_spec(cfg.model)
    if cfg.data.source == "stdlib" and spec.vocab_size < 256:
        raise ValueError(
            f"model.vocab_size: byte-level stdlib text needs >= 256 tokens, the model has {spec.vocab_size}"
        )
    if cfg.data.seq_len > spec.max_seq_len:
        raise ValueError(
            f"data.seq_len: {cfg.data.seq_len} exceeds the model's max_seq_len {spec.max_seq_len}; "
            f"lower data.seq_len or raise model.max_seq_len"
        )
    if cfg.checkpoint.init_from_hf and not Path(cfg.checkpoint.init_from_hf).is_dir():
        raise ValueError(
            f"checkpoint.init_from_hf: {cfg.checkpoint.init_from_hf!r} is not a folder; point it at a "
            f"Hugging Face model folder with *.safetensors and config.json"
        )
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
    n_tokens = _stream_tokens(cfg, spec.vocab_size)
    n_val = max(1, int(n_tokens * cfg.data.val_fraction))
    if (n_tokens - n_val - 1) // cfg.data.seq_len < gb or (n_val - 1) // cfg.data.seq_len < 1:
        raise ValueError(
            f"data: {n_tokens} tokens are too few for a global batch of {gb} x {cfg.data.seq_len} "
            f"tokens plus a validation split; add data or lower train.global_batch_size"
        )
    return ResolvedJob(spec=spec, dims=dims, micro_batch=micro, accumulation=gb // (micro * dims.dp))


def check_layout(cfg: JobConfig, spec: ModelSpec, dims: ParallelDims) -> None:
    """Layouts that cannot run, refused before launch with one line naming the field: TP degrees that do not
    split the heads or matmuls, more pipeline stages than layers, combinations torch does not support."""
    p = cfg.parallel
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
    if dims.pp > 1:
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
