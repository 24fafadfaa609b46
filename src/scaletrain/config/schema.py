"""The typed job config: one section per component, validated before any work starts.

Every section forbids unknown keys and coerces nothing silently (a string is not an int), so a typo in a
TOML file or a `key=value` override is one clear error instead of a default quietly used.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)


class RunConfig(Section):
    name: str = Field("default", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$",
                      description="run name; outputs go to output_dir/name")
    output_dir: str = Field("runs", min_length=1, description="parent folder of run folders")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: CUDA GPUs with NCCL when present, else CPU ranks with gloo")
    seed: int = Field(0, ge=0, description="seeds model init, data order and dropout")


class ModelConfig(Section):
    name: str = Field("tiny", description="built-in preset: see `scaletrain models`")
    dim: int | None = Field(None, gt=0, description="override the preset's hidden size")
    n_layers: int | None = Field(None, gt=0)
    n_heads: int | None = Field(None, gt=0)
    n_kv_heads: int | None = Field(None, gt=0)
    ffn_dim: int | None = Field(None, gt=0)
    vocab_size: int | None = Field(None, gt=0)
    max_seq_len: int | None = Field(None, gt=0)


class DataConfig(Section):
    source: Literal["stdlib", "tokens", "synthetic"] = Field(
        "stdlib", description="stdlib: this Python's own standard library sources as bytes; "
        "tokens: a flat file of token ids (path, token_dtype); synthetic: random tokens")
    path: str | None = Field(None, description="token file for source='tokens'")
    token_dtype: Literal["uint8", "uint16", "int32"] = "uint16"
    seq_len: int = Field(256, gt=1, description="tokens per sample")
    val_fraction: float = Field(0.05, gt=0.0, lt=0.5, description="tail share of the stream held out")
    max_bytes: int = Field(4_000_000, gt=0, description="stdlib source: bytes of text read, at most")
    synthetic_tokens: int = Field(1_000_000, gt=0, description="synthetic source: stream length")

    @model_validator(mode="after")
    def _path_needed(self) -> DataConfig:
        if self.source == "tokens" and not self.path:
            raise ValueError("data.path: required when data.source='tokens'; set data.path=FILE")
        return self


class ParallelConfig(Section):
    """Degrees of the device mesh. Their product is the world size; -1 on dp_shard fills the rest.

    dp_replicate > 1 with dp_shard == 1 is DDP; dp_shard > 1 is FSDP2; both > 1 is HSDP.
    """

    dp_replicate: int = Field(1, ge=1, description="replicated data-parallel degree (DDP, or HSDP's outer dim)")
    dp_shard: int = Field(-1, ge=-1, description="sharded data-parallel degree (FSDP2); -1: the rest")
    tp: int = Field(1, ge=1, description="tensor-parallel degree")
    pp: int = Field(1, ge=1, description="pipeline-parallel degree")
    fsdp_reshard_after_forward: bool = Field(
        True, description="False keeps gathered params from forward to backward (ZeRO-2-like)")
    ddp_bucket_cap_mb: float = Field(25.0, gt=0, description="DDP gradient bucket size, MiB")

    @model_validator(mode="after")
    def _zero_shard(self) -> ParallelConfig:
        if self.dp_shard == 0:
            raise ValueError("parallel.dp_shard: must be -1 (auto) or >= 1")
        if self.tp > 1 or self.pp > 1:
            raise ValueError("parallel.tp/pp: tensor and pipeline parallelism are not in this version; "
                             "set parallel.tp=1 parallel.pp=1")
        return self


class TrainConfig(Section):
    steps: int = Field(300, gt=0, description="optimizer steps")
    global_batch_size: int = Field(16, gt=0, description="sequences per optimizer step, all ranks together")
    micro_batch_size: int | None = Field(
        None, gt=0, description="sequences per rank per forward; None: no accumulation")
    lr: float = Field(3e-3, gt=0.0, description="peak learning rate")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="final lr as a share of the peak")
    warmup_steps: int = Field(20, ge=0, description="linear warmup; capped at steps")
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = Field(0.1, ge=0.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    eps: float = Field(1e-8, gt=0.0)
    grad_clip: float = Field(1.0, ge=0.0, description="max global grad norm; 0 disables clipping")
    eval_interval: int = Field(100, ge=0, description="steps between validation runs; 0: only at the end")
    eval_batches: int = Field(4, gt=0, description="validation batches (global_batch_size each) per run")


class PrecisionConfig(Section):
    dtype: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="compute dtype; weights and optimizer states stay fp32")
    reduce_dtype: Literal["fp32", "bf16"] = Field("fp32", description="gradient reduction dtype (FSDP)")
    loss_scale_init: float = Field(2.0**16, gt=0, description="fp16: initial loss scale")
    loss_scale_growth_interval: int = Field(2000, gt=0, description="fp16: good steps before scale doubles")


class CheckpointConfig(Section):
    interval_steps: int = Field(0, ge=0, description="save every N steps; 0: never during training")
    save_final: bool = Field(False, description="save after the last step")
    dir: str | None = Field(None, description="where checkpoints go; default: the run folder's checkpoints/")


class MonitorConfig(Section):
    log_interval: int = Field(10, gt=0, description="steps between loss reports (each costs one all-reduce)")
    progress: bool = Field(True, description="progress bar on rank 0")
    all_ranks_log: bool = Field(False, description="also show log lines of ranks other than 0")


class LaunchConfig(Section):
    nproc_per_node: int = Field(0, ge=0, description="ranks on this host; 0: all local GPUs, or 2 CPU ranks")
    nnodes: int = Field(1, gt=0)
    rdzv_endpoint: str = Field("127.0.0.1:0", description="host:port of the c10d rendezvous; port 0 picks a free one")
    max_restarts: int = Field(0, ge=0, description="worker-group restarts by the torchrun agent")
    collective_timeout_s: float = Field(600.0, gt=0, description="process-group timeout for a collective")


class JobConfig(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
