"""The checks job resolution runs before any process starts: a layout the model and torch can run, fp8's needs,
the pipeline's micro-batches, the data and a Hugging Face checkpoint to start from. Each raises ValueError as one
line naming the field and the fix."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from scaletrain.config.layout import DataParallelMode, Layout
from scaletrain.config.precisions import precision
from scaletrain.config.schedules import pipeline_schedule
from scaletrain.config.schema import JobConfig
from scaletrain.models.spec import ModelSpec


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


def check_layout(cfg: JobConfig, spec: ModelSpec, layout: Layout) -> None:
    """Layouts that cannot run, refused before launch with one line naming the field: TP degrees that do not
    split the heads or matmuls, more pipeline stages than layers, combinations torch does not support."""
    p = cfg.parallel
    if p.cpu_offload and not layout.mode.sharded:
        raise ValueError(
            f"parallel.cpu_offload: offloads FSDP2's shards, but this layout is {layout.mode} (dp_shard="
            f"{layout.dp_shard}); shard with parallel.dp_shard > 1 or set parallel.cpu_offload=false"
        )
    if p.cpu_offload and layout.pp > 1:
        raise ValueError(
            "parallel.cpu_offload: not combined with pipeline parallelism (torch's pipeline schedules keep stages "
            "unsharded on the device); use parallel.pp=1 or parallel.cpu_offload=false"
        )
    check_fp8(cfg)
    if layout.ep > 1:
        check_expert_parallel(spec, layout)
    if layout.tp > 1:
        if layout.mode is DataParallelMode.DDP:
            raise ValueError(
                f"parallel.tp: DDP (dp_replicate={layout.dp_replicate}, dp_shard=1) does not combine "
                f"with tensor parallelism; shard instead (parallel.dp_shard={layout.dp_replicate} "
                f"parallel.dp_replicate=1) or use HSDP"
            )
        spec.check_tp(layout.tp)
        if spec.n_experts is not None and spec.splits_experts:
            check_experts_under_tp(spec, layout)
        if p.sequence_parallel and cfg.data.seq_len % layout.tp:
            raise ValueError(
                f"parallel.sequence_parallel: data.seq_len={cfg.data.seq_len} is not divisible by parallel.tp={layout.tp}"
            )
        if p.sequence_parallel and p.tp_plan == "auto":
            raise ValueError(
                "parallel.sequence_parallel: needs parallel.tp_plan=model (the auto plan shards only the linears)"
            )
    if layout.cp > 1:
        check_context_parallel(cfg, spec, layout)
    if layout.pp > 1:
        spec.check_pp(layout.pp)
        stages = layout.pp * p.stages_per_rank
        if stages > spec.n_blocks:
            raise ValueError(
                f"parallel.pp: {layout.pp} x {p.stages_per_rank} stage(s) per rank = {stages} pipeline "
                f"stages, but the model has only {spec.n_blocks} layers; lower parallel.pp"
            )
        if precision(cfg.precision.dtype).loss_scaling:
            raise ValueError(
                f"precision.dtype: {cfg.precision.dtype} loss scaling does not run inside a pipeline "
                f"schedule; use bf16 with parallel.pp > 1"
            )
        pipeline_microbatches(cfg, layout)


def check_expert_parallel(spec: ModelSpec, layout: Layout) -> None:
    """ep > 1 needs a mixture-of-experts model whose experts and dp_shard ranks it divides, and a layout it has
    been proven with (parity tests: tests/test_moe.py); the rest is refused here."""
    ep, experts = layout.ep, spec.n_experts
    if experts is None:
        raise ValueError(f"parallel.ep: the {spec.family} family is dense (no experts); use parallel.ep=1")
    if not spec.splits_experts:
        raise ValueError(
            f"parallel.ep: {spec.model_name}'s {experts} experts are laid out in a way expert parallelism does not "
            f"split (it splits the built-in moe family's and transformers' packed [gate; up] experts without "
            f"biases); use parallel.ep=1"
        )
    if experts % ep:
        raise ValueError(f"parallel.ep: {ep} does not divide model.n_experts={experts}; pick an ep that divides it")
    if layout.dp_shard % ep:
        raise ValueError(
            f"parallel.ep: {ep} does not divide the {layout.dp_shard} dp_shard ranks it is carved from; "
            f"pick an ep that divides parallel.dp_shard"
        )


def check_experts_under_tp(spec: ModelSpec, layout: Layout) -> None:
    """Under TP each rank routes a piece of the tokens through whole experts (models/moe/parallelize.py), so the
    experts' gradients are summed over the TP ranks by FSDP2 (parallel/dims.py expert_fsdp_mesh): that needs FSDP."""
    if layout.dp_shard < 2:
        raise ValueError(
            f"parallel.tp: {spec.model_name}'s experts take a piece of the tokens on each TP rank and FSDP sums "
            f"their gradients over them; shard with parallel.dp_shard >= 2 (got {layout.dp_shard}) or use "
            f"parallel.tp=1"
        )


def check_context_parallel(cfg: JobConfig, spec: ModelSpec, layout: Layout) -> None:
    """cp > 1 needs a model whose attention can be split, sequences that cut into 2·cp equal chunks (a head and a
    tail chunk per rank), and an attention method this device runs."""
    from scaletrain.parallel.context_parallel import pick_cp_method
    from scaletrain.parallel.runtime import pick_device_type

    if not spec.supports_cp:
        raise ValueError(
            f"parallel.cp: the {spec.family} family's attention cannot be split over ranks; use parallel.cp=1"
        )
    seq = cfg.data.seq_len
    if seq % (2 * layout.cp):
        raise ValueError(
            f"parallel.cp: data.seq_len={seq} is not divisible by 2 x parallel.cp = {2 * layout.cp} (each rank "
            f"takes a head and a tail chunk); pick a data.seq_len that is a multiple of {2 * layout.cp}"
        )
    if cfg.parallel.sequence_parallel and (seq // layout.cp) % layout.tp:
        raise ValueError(
            f"parallel.sequence_parallel: the {seq // layout.cp} tokens per cp rank are not divisible by "
            f"parallel.tp={layout.tp}; pick a data.seq_len that is a multiple of {2 * layout.cp * layout.tp}"
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


def pipeline_microbatches(cfg: JobConfig, layout: Layout) -> int:
    """Micro-batches per step of each pipeline: parallel.pp_microbatches, else one per train.micro_batch_size,
    else the number of stages (the fewest that fill every schedule). ValueError names the field."""
    p = cfg.parallel
    per_rank = cfg.train.global_batch_size // layout.dp
    stages = layout.pp * p.stages_per_rank
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
    rounds = max(1, m // layout.pp)
    if schedule.microbatch_rounds and m % rounds:
        raise ValueError(
            f"parallel.pp_microbatches: {p.pp_schedule} needs a multiple of {rounds} micro-batches "
            f"(rounds of pp={layout.pp}), got {m}"
        )
    return m


def check_embedding_memory(cfg: JobConfig, spec: ModelSpec, layout: Layout, world_size: int) -> None:
    """A model's embedding tables (ModelSpec.embedding_tables) refused before launch (one line) when the busiest
    rank's share of their weights, gradients and AdamW states (16 bytes an element, fp32) under
    parallel.embedding_sharding exceeds one rank's memory: a GPU's, or on CPU ranks the host's RAM over the ranks
    on it."""
    path = spec.embedding_tables()
    if path is None:
        return
    from scaletrain.config.table_sharding import table_elements_per_rank
    from scaletrain.parallel.runtime import pick_device_type

    tables: Any = spec.build("meta").get_submodule(path)  # names, rows, dim (ModelSpec.embedding_tables)
    how = cfg.parallel.embedding_sharding if layout.dp > 1 else "none"
    need = 16 * table_elements_per_rank(list(tables.rows), int(tables.dim), how, layout.dp)
    if pick_device_type(cfg.run.device) == "cuda":
        import torch

        have: float | None = float(torch.cuda.get_device_properties(0).total_memory)
        where = "a GPU's memory"
    else:
        host = host_memory_bytes()
        have = host / max(1, world_size // cfg.launch.nnodes) if host else None
        where = "a CPU rank's share of the host's RAM"
    if have is not None and need > have:
        raise ValueError(
            f"parallel.embedding_sharding: the embedding tables need {need / 1e9:.1f} GB on the busiest rank "
            f"(weights, gradients and AdamW states, {how} sharding over {layout.dp} rank(s)), more than "
            f"{where} ({have / 1e9:.1f} GB); use more ranks, embedding_sharding=row, or a lower model.max_rows"
        )


def host_memory_bytes() -> float | None:
    """This host's physical memory in bytes (POSIX sysconf; None where it does not say)."""
    import os

    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None
