"""Everything about a job that can be checked before a process is started, with one-line errors."""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scaletrain.config.schema import JobConfig
from scaletrain.models.llama import LlamaArgs
from scaletrain.models.registry import model_args
from scaletrain.parallel.dims import ParallelDims


@dataclass(frozen=True)
class ResolvedJob:
    args: LlamaArgs
    dims: ParallelDims
    micro_batch: int
    accumulation: int


def _stream_tokens(cfg: JobConfig) -> int:
    d = cfg.data
    if d.source == "synthetic":
        return d.synthetic_tokens
    if d.source == "tokens":
        p = Path(d.path)
        if not p.is_file():
            raise ValueError(f"data.path: {d.path!r} does not exist; point it at a flat file of token ids")
        size = p.stat().st_size
        width = np.dtype(d.token_dtype).itemsize
        if size % width:
            raise ValueError(f"data.path: {d.path!r} has {size} bytes, not a whole number of "
                             f"{d.token_dtype} tokens; check data.token_dtype")
        return size // width
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if not stdlib.is_dir():
        raise ValueError(f"data.source: this Python's stdlib folder {stdlib} is missing; use data.source=synthetic")
    return d.max_bytes  # the stdlib of any CPython is far larger than the default max_bytes


def resolve_job(cfg: JobConfig, world_size: int) -> ResolvedJob:
    """Check the config against a world size; raise ValueError whose message names the field and the fix."""
    args = model_args(cfg.model)
    if cfg.data.source == "stdlib" and args.vocab_size < 256:
        raise ValueError(f"model.vocab_size: byte-level stdlib text needs >= 256 tokens, the model has "
                         f"{args.vocab_size}")
    if cfg.data.seq_len > args.max_seq_len:
        raise ValueError(f"data.seq_len: {cfg.data.seq_len} exceeds the model's max_seq_len {args.max_seq_len}; "
                         f"lower data.seq_len or raise model.max_seq_len")
    dims = ParallelDims.resolve(cfg.parallel, world_size)
    gb = cfg.train.global_batch_size
    if gb % dims.dp:
        raise ValueError(f"train.global_batch_size: {gb} is not divisible by the data-parallel degree {dims.dp}")
    micro = cfg.train.micro_batch_size or gb // dims.dp
    if gb % (micro * dims.dp):
        raise ValueError(f"train.micro_batch_size: {gb} sequences per step do not split into micro-batches of "
                         f"{micro} on {dims.dp} data-parallel ranks; pick a divisor of {gb // dims.dp}")
    n_tokens = _stream_tokens(cfg)
    n_val = max(1, int(n_tokens * cfg.data.val_fraction))
    if (n_tokens - n_val - 1) // cfg.data.seq_len < gb or (n_val - 1) // cfg.data.seq_len < 1:
        raise ValueError(f"data: {n_tokens} tokens are too few for a global batch of {gb} x {cfg.data.seq_len} "
                         f"tokens plus a validation split; add data or lower train.global_batch_size")
    return ResolvedJob(args=args, dims=dims, micro_batch=micro, accumulation=gb // (micro * dims.dp))


def default_nproc(device: str) -> int:
    """Ranks for this host when launch.nproc_per_node is 0: every local GPU, or 2 CPU ranks."""
    import torch

    if device in ("auto", "cuda") and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 2


def run_dir(cfg: JobConfig) -> Path:
    return Path(cfg.run.output_dir) / cfg.run.name


def under_external_launcher() -> bool:
    """True inside a process started by an external torchrun (or any launcher setting RANK/WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
