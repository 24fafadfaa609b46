"""Settings whose "auto" depends on the device the ranks run on, decided once before launch: the compute dtype,
whether blocks are compiled, and how many ranks a host starts."""

from __future__ import annotations

from scaletrain.config.precisions import resolve_dtype
from scaletrain.config.schedules import pipeline_schedule
from scaletrain.config.schema import JobConfig


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


def default_nproc(device: str) -> int:
    """Ranks for this host when launch.nproc_per_node is 0: every local GPU, or 2 CPU ranks."""
    import torch

    if device in ("auto", "cuda") and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 2
