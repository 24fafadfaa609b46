"""The typed job config: one section per component, validated before any work starts.

Every section forbids unknown keys and coerces nothing silently (a string is not an int), so a typo in a
TOML file or a `key=value` override is one clear error instead of a default quietly used.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from scaletrain.config.precisions import REDUCE_DTYPES, DtypeSetting
from scaletrain.config.schedules import DEFAULT_SCHEDULE, SCHEDULE_NAMES, pipeline_schedule

# Upper bounds on counts. Python ints are unbounded but torch, numpy and TensorBoard hold steps, sizes and positions
# as int64; each bound is far beyond any real run and keeps the products the trainer forms inside int64.
MAX_STEPS = 10**9  # optimizer steps (and step intervals): 3 years at 10 steps/s; x MAX_SEQUENCES < 2**63 samples
MAX_SEQUENCES = 2**24  # sequences per step: ~1000x the largest published LLM batches
MAX_TOKENS_PER_SEQUENCE = 2**24  # 16.8M tokens per sample, beyond the longest trained contexts; x MAX_SEQUENCES < 2**63
MAX_MODEL_DIM = 2**24  # hidden/FFN/vocabulary/layer/head counts: a weight's elements (a product of two) < 2**63
MAX_RANKS = 2**24  # ranks, nodes and parallel degrees: ~100x the largest GPU clusters
MAX_SEED = 2**50  # the loader seeds torch with seed x 7,919 + epoch, which must stay below 2**63
MAX_SECONDS = 10**9  # ~32 years: what datetime.timedelta and c10d's int64 millisecond timeouts accept
MAX_STREAM_TOKENS = 2**36  # a stream held in memory as int64 on every rank: 512 GiB


class Section(BaseModel):
    # allow_inf_nan=False: `inf` and `nan` are valid TOML floats, and nothing here means them
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, allow_inf_nan=False)


class RunConfig(Section):
    name: str = Field(
        "default", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$", description="run name; outputs go to output_dir/name"
    )
    output_dir: str = Field("runs", min_length=1, description="parent folder of run folders")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: CUDA GPUs with NCCL when present, else CPU ranks with gloo"
    )
    seed: int = Field(0, ge=0, le=MAX_SEED, description="seeds model init, data order and dropout")


class ModelConfig(Section):
    """`[model]`: `name` picks a preset, whose family owns every other key (its args dataclass: e.g. the built-in
    Llama's dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab_size, max_seq_len, rope_theta, norm_eps); a family
    chosen by a key of its own instead of a preset (model.hf = FOLDER: a Hugging Face model folder) reads that key.
    The family found checks the keys strictly, one line naming the key (models/registry.py model_spec), before
    any rank starts."""

    model_config = ConfigDict(extra="allow")  # the family's own keys, typed and checked by the family

    name: str = Field("tiny", description="preset: see `scaletrain models`")

    def family_keys(self) -> dict[str, Any]:
        """Every key of the section but `name`, as written."""
        return dict(self.model_extra or {})


class TaskConfig(Section):
    """`[task]`: what the job trains the model to do (scaletrain/tasks/: its batch, loss, normalisation, metrics and
    evaluation); any other key is an option of that task, checked by it (tasks/registry.py task_for)."""

    model_config = ConfigDict(extra="allow")  # the task's own options, typed and checked by the task

    name: str = Field(
        "causal-lm",
        min_length=1,
        description="task: causal-lm (next-token prediction), image-classification (docs/vision.md), diffusion "
        "(docs/diffusion.md), vision-language (docs/vision-language.md), recommendation (docs/recommendation.md)",
    )

    def options(self) -> dict[str, Any]:
        """Every key of the section but `name`, as written."""
        return dict(self.model_extra or {})


DATA_SOURCES = ("auto", "stdlib", "tokens", "prepared", "megatron", "synthetic")


class MixEntry(Section):
    """One dataset of data.mix given as a section: `[data.mix.web]` path = ..., weight = ..."""

    path: str = Field(min_length=1, description="a prepared dataset folder, a Megatron PREFIX, or a flat token file")
    weight: float = Field(gt=0.0, description="share of samples, relative to the other datasets' weights")
    source: Literal["auto", "tokens", "prepared", "megatron"] = Field("auto", description="auto: from the path")
    token_dtype: Literal["uint8", "uint16", "int32"] = Field("uint16", description="flat token files only")


class DataConfig(Section):
    source: Literal[DATA_SOURCES] = Field(  # type: ignore[valid-type]
        "auto",
        description="auto: stdlib without data.path, else recognised from the path (a folder with manifest.json: "
        "prepared; PREFIX with .bin and .idx: megatron; another file: tokens); stdlib: this Python's own standard "
        "library sources as bytes; tokens: a flat file of token ids (token_dtype); synthetic: random tokens",
    )
    path: str | None = Field(
        None, description="prepared dataset folder, Megatron PREFIX (.bin/.idx), or flat token file"
    )
    token_dtype: Literal["uint8", "uint16", "int32"] = Field("uint16", description="flat token files: the id type")
    mix: dict[str, float | MixEntry] = Field(
        default_factory=dict,
        description='several datasets by weight instead of data.path: "PATH" = weight, or NAME = {path, weight}',
    )
    seq_len: int = Field(256, gt=1, le=MAX_TOKENS_PER_SEQUENCE, description="tokens per sample")
    val_fraction: float = Field(
        0.05, gt=0.0, lt=0.5, description="tail share held out (a prepared dataset uses its own val split)"
    )
    mask_doc_starts: bool = Field(
        False, description="no loss on the first token of a document packed after another (needs documents)"
    )
    packing: Literal["concat", "pad", "document"] = Field(
        "concat",
        description="concat: fixed windows of the token stream, documents back to back under causal attention; "
        "pad: one document per row, padded; document: several documents per row, each attending only to itself "
        "with positions from 0 (pad and document need document boundaries; the loss counts trained tokens)",
    )
    prefetch: int = Field(2, ge=0, le=64, description="steps read ahead by a background thread; 0: read in the step")
    cache_dir: str | None = Field(
        None,
        description="sample orders and index arrays; default: .scaletrain-cache beside the data, or "
        "~/.cache/scaletrain when that folder is read-only",
    )
    checksums: Literal["first_use", "always", "sizes"] = Field(
        "first_use",
        description="prepared shards: sha256 on a dataset's first use (remembered in the cache), at every start, "
        "or only sizes (always checked)",
    )
    max_bytes: int = Field(
        4_000_000, gt=0, le=MAX_STREAM_TOKENS, description="stdlib source: bytes of text read, at most"
    )
    synthetic_tokens: int = Field(1_000_000, gt=0, le=MAX_STREAM_TOKENS, description="synthetic source: stream length")

    @model_validator(mode="after")
    def _path_needed(self) -> DataConfig:
        if self.source in ("tokens", "prepared", "megatron") and not self.path:
            raise ValueError(f"data.path: required when data.source='{self.source}'; set data.path=PATH")
        if self.mix:
            if self.path:
                raise ValueError("data.mix: set either data.path (one dataset) or data.mix (several), not both")
            if self.source != "auto":
                raise ValueError(f"data.source: must stay 'auto' with data.mix (got '{self.source}')")
            for name, entry in self.mix.items():
                if isinstance(entry, float) and not entry > 0:
                    raise ValueError(f"data.mix.{name}: weight must be > 0 (got {entry})")
        return self

    def datasets(self) -> list[tuple[str, MixEntry]]:
        """(name, entry) of every dataset of data.mix; a bare weight's name is its path."""
        return [(name, MixEntry(path=name, weight=e) if isinstance(e, float) else e) for name, e in self.mix.items()]


class ParallelConfig(Section):
    """Degrees of the device mesh, and how each parallelism is applied. The degrees' product is the world size;
    -1 on dp_shard fills the rest.

    dp_replicate > 1 with dp_shard == 1 is DDP; dp_shard > 1 is FSDP2; both > 1 is HSDP (config/layout.py
    DataParallelMode.of decides; the resolved degrees are a Layout, resolve/job.py). tp splits every block's
    matmuls (DTensor), pp splits the layers into pipeline stages (torch.distributed.pipelining), cp splits every
    sequence over ranks (parallel/context_parallel.py; its ranks join the FSDP shard group).
    Applied in one fixed order: pipeline split -> CP -> embedding tables -> EP -> TP -> activation checkpointing ->
    compile -> FSDP/DDP.
    """

    dp_replicate: int = Field(
        1, ge=1, le=MAX_RANKS, description="replicated data-parallel degree (DDP, or HSDP's outer dim)"
    )
    dp_shard: int = Field(-1, ge=-1, le=MAX_RANKS, description="sharded data-parallel degree (FSDP2); -1: the rest")
    tp: int = Field(1, ge=1, le=MAX_RANKS, description="tensor-parallel degree")
    pp: int = Field(1, ge=1, le=MAX_RANKS, description="pipeline-parallel degree")
    cp: int = Field(
        1, ge=1, le=MAX_RANKS, description="context-parallel degree: each sequence split over cp ranks (head+tail)"
    )
    embedding_sharding: Literal["row", "table", "none"] = Field(
        "row",
        description="a recommender's embedding tables over the data-parallel ranks (parallel/embedding.py): row "
        "(each table's rows split evenly), table (each table whole on one rank), none (replicated like the MLPs)",
    )
    ep: int = Field(
        1,
        ge=1,
        le=MAX_RANKS,
        description="expert-parallel degree of a mixture-of-experts model: its routed experts split over ep ranks "
        "carved from the dp_shard ranks, tokens sent to them by all-to-all (parallel/expert.py); the expert "
        "weights are sharded by FSDP over the dp_shard / ep ranks left",
    )
    cp_method: Literal["auto", "allgather", "ring"] = Field(
        "auto",
        description="cp > 1: allgather gathers K and V of the whole sequence on every rank (any device, gloo too); "
        "ring: torch's context_parallel SDPA (CUDA only); auto: ring on CUDA unless the model has fewer KV heads "
        "than query heads (GQA: the gathered K and V are small), else allgather",
    )
    fsdp_reshard_after_forward: bool = Field(
        True, description="False keeps gathered params from forward to backward (ZeRO-2-like)"
    )
    fsdp_accumulate: Literal["sharded", "unsharded"] = Field(
        "sharded",
        description="FSDP/HSDP gradient accumulation: sharded reduce-scatters every micro-batch into the sharded "
        "fp32 gradient (1/dp_shard of the memory); unsharded keeps full fp32 gradients until the last micro-batch "
        "(one reduce-scatter per step: faster for small models). Pipelines (pp > 1) always accumulate unsharded",
    )
    cpu_offload: bool = Field(
        False,
        description="FSDP/HSDP: keep sharded parameters, gradients and optimizer states in host memory "
        "(FSDP2 CPUOffloadPolicy; the optimizer steps on the CPU)",
    )
    ddp_bucket_cap_mb: float = Field(25.0, gt=0, description="DDP gradient bucket size, MiB")
    # tensor parallel
    sequence_parallel: bool = Field(
        False, description="tp > 1: norms and residuals sharded along the sequence (saves activation memory)"
    )
    loss_parallel: bool = Field(
        True, description="tp > 1 without pp: cross-entropy on vocabulary-sharded logits, no logits all-gather"
    )
    tp_plan: Literal["model", "auto"] = Field(
        "model", description="model: the model's own TP plan; auto: q/k/v/o and MLP linears found by structure"
    )
    # pipeline parallel
    pp_schedule: Literal[SCHEDULE_NAMES] = Field(  # type: ignore[valid-type]
        DEFAULT_SCHEDULE, description="pipeline schedule (torch.distributed.pipelining name)"
    )
    pp_microbatches: int | None = Field(
        None,
        gt=0,
        le=MAX_SEQUENCES,
        description="pipeline micro-batches per step and data-parallel rank; "
        "None: from train.micro_batch_size, else the number of stages",
    )
    pp_stages_per_rank: int | None = Field(
        None, gt=0, le=MAX_MODEL_DIM, description="pipeline stages per rank; None: 1 for GPipe/1F1B, 2 for the others"
    )
    pp_balance: Literal["cost", "layers"] = Field(
        "cost",
        description="stage split: cost balances estimated FLOPs (embedding and head counted); "
        "layers: equal layer counts",
    )
    # memory and speed
    activation_checkpoint: Literal["none", "selective", "full"] = Field(
        "none", description="recompute activations in backward: none, selective (see ac_selective) or every block"
    )
    ac_selective: Literal["op", "layer"] = Field(
        "op",
        description="selective: op keeps matmul/attention outputs and recomputes the rest; "
        "layer checkpoints every ac_every-th block",
    )
    ac_every: int = Field(2, ge=1, le=MAX_MODEL_DIM, description="selective layer checkpointing: every k-th block")
    compile: bool | Literal["auto"] = Field(
        "auto",
        description="torch.compile each transformer block; auto: off on a CPU, on with fp8 on a GPU, otherwise on a "
        "GPU when the first steps' time says the compilation pays back over the steps left",
    )

    @property
    def stages_per_rank(self) -> int:
        if self.pp_stages_per_rank is not None:
            return self.pp_stages_per_rank
        return pipeline_schedule(self.pp_schedule).stages_per_rank

    @model_validator(mode="after")
    def _consistent(self) -> ParallelConfig:
        if self.dp_shard == 0:
            raise ValueError("parallel.dp_shard: must be -1 (auto) or >= 1")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel: needs parallel.tp > 1")
        v, sched = self.stages_per_rank, pipeline_schedule(self.pp_schedule)
        if sched.placement == "single" and v != 1:
            raise ValueError(
                f"parallel.pp_stages_per_rank: {sched.name} runs 1 stage per rank (got {v}); "
                f"use Interleaved1F1B for more"
            )
        if sched.v_shaped and v != 2:
            raise ValueError(f"parallel.pp_stages_per_rank: {sched.name} runs exactly 2 stages per rank (got {v})")
        if sched.placement != "single" and v < 2:
            raise ValueError(f"parallel.pp_stages_per_rank: {sched.name} needs >= 2 stages per rank (got {v})")
        if self.compile is True and self.pp > 1 and sched.split_backward:
            raise ValueError(
                f"parallel.compile: {sched.name} splits backward into input and weight parts, which "
                f"torch.compile does not support; use 1F1B or Interleaved1F1B"
            )
        return self


class TrainConfig(Section):
    steps: int = Field(300, gt=0, le=MAX_STEPS, description="optimizer steps")
    global_batch_size: int = Field(
        16, gt=0, le=MAX_SEQUENCES, description="sequences per optimizer step, all ranks together"
    )
    micro_batch_size: int | None = Field(
        None, gt=0, le=MAX_SEQUENCES, description="sequences per rank per forward; None: no accumulation"
    )
    lr: float = Field(3e-3, gt=0.0, description="peak learning rate")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="final lr as a share of the peak")
    warmup_steps: int = Field(20, ge=0, le=MAX_STEPS, description="linear warmup; capped at steps")
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = Field(0.1, ge=0.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    eps: float = Field(1e-8, gt=0.0)
    optimizer_impl: Literal["foreach", "fused"] = Field(
        "foreach",
        description="AdamW's kernels: foreach (one kernel per op over a parameter list) or fused (one kernel for the "
        "whole update; CPU and CUDA; several times faster on CPU ranks, e.g. a recommender's large tables)",
    )
    grad_clip: float = Field(1.0, ge=0.0, description="max global grad norm; 0 disables clipping")
    eval_interval: int = Field(100, ge=0, le=MAX_STEPS, description="steps between validation runs; 0: only at the end")
    eval_batches: int = Field(4, gt=0, le=MAX_STEPS, description="validation batches (global_batch_size each) per run")
    nan_policy: Literal["stop", "skip"] = Field(
        "stop", description="a non-finite loss or gradient: stop with the step, or skip that step's update"
    )
    max_skipped_steps: int = Field(
        10, ge=0, le=MAX_STEPS, description="nan_policy=skip: stop after this many skipped steps"
    )
    sample_prompts: list[str] = Field(
        default_factory=list,
        max_length=16,
        description="prompts answered (greedy, sample_tokens at most) at each evaluation into metrics.jsonl, "
        "TensorBoard and the report; a chat turn when the data's tokenizer has a chat template, else plain text",
    )
    sample_tokens: int = Field(32, gt=0, le=4096, description="sample_prompts: tokens generated per answer, at most")


class PrecisionConfig(Section):
    dtype: DtypeSetting = Field(
        "auto",
        description="compute dtype (fp32, bf16, fp16); auto: bf16 on a GPU with bf16 or with fp8, fp32 on a CPU. "
        "Weights and optimizer states stay fp32",
    )
    reduce_dtype: Literal[REDUCE_DTYPES] = Field(  # type: ignore[valid-type]
        "fp32", description="gradient reduction dtype (FSDP)"
    )
    fp8: Literal["none", "tensorwise", "rowwise"] = Field(
        "none",
        description="FP8 matmuls in the blocks' linears (torchao float8, on top of dtype=bf16): tensorwise "
        "(one scale per tensor; float8 FSDP all-gather) or rowwise (one scale per row); emulated on CPU",
    )
    loss_scale_init: float = Field(2.0**16, gt=0, description="fp16: initial loss scale")
    loss_scale_growth_interval: int = Field(
        2000, gt=0, le=MAX_STEPS, description="fp16: good steps before scale doubles"
    )


class CheckpointConfig(Section):
    interval_steps: int = Field(0, ge=0, le=MAX_STEPS, description="save every N steps; 0: not by step count")
    interval_minutes: float = Field(0.0, ge=0.0, description="save when this many minutes passed; 0: not by time")
    save_final: bool = Field(False, description="save after the last step")
    keep: int = Field(3, ge=0, le=MAX_STEPS, description="committed checkpoints kept (newest); 0 keeps all")
    async_save: bool = Field(True, description="write in the background (dcp.async_save) while training goes on")
    async_writer: Literal["process", "thread"] = Field(
        "process",
        description="async saves: DCP writes in a separate process (off this process's GIL) or a background thread",
    )
    async_commit_after_steps: int = Field(
        2,
        ge=1,
        le=MAX_STEPS,
        description="an async save commits in the background once written; one still being written this many "
        "steps after it started is waited for (a bound on what a failure can lose)",
    )
    memory_interval_steps: int = Field(
        0,
        ge=0,
        le=MAX_STEPS,
        description="every N steps each rank keeps its shard in host memory (tmpfs, outlives the ranks); a restart "
        "resumes from it when newer than the disk checkpoints; 0: off. One node only",
    )
    resume: bool = Field(True, description="start from the newest complete checkpoint in dir when there is one")
    verify_on_resume: bool = Field(True, description="check sha256 of every file before resuming from it")
    dir: str | None = Field(None, description="where checkpoints go; default: the run folder's checkpoints/")
    init_from_hf: str | None = Field(
        None,
        description="folder of a Hugging Face Llama checkpoint (safetensors) to start the built-in Llama from; a "
        "resumable checkpoint of this run takes precedence. Other architectures: model.hf",
    )


class MonitorConfig(Section):
    log_interval: int = Field(
        10, gt=0, le=MAX_STEPS, description="steps between loss reports (each costs one all-reduce)"
    )
    progress: bool = Field(True, description="progress bar on rank 0")
    all_ranks_log: bool = Field(False, description="also show log lines of ranks other than 0")
    breakdown: bool = Field(
        True,
        description="step-time breakdown (data, forward, backward, exposed comm, optimizer), MFU, memory and "
        "straggler spread per rank in every log record (one small all-gather per log step)",
    )
    tensorboard: bool = Field(True, description="also write TensorBoard event files to the run's tensorboard/")
    trackers: list[Literal["mlflow", "wandb"]] = Field(
        default_factory=list,
        description="experiment trackers rank 0 also sends the config, every metrics record and the summary to, "
        "beside metrics.jsonl and TensorBoard: mlflow, wandb (the trackers extra: pip install "
        "'scaletrain[trackers]'). On the command line: monitor.trackers=mlflow,wandb",
    )
    mlflow_tracking_uri: str | None = Field(
        None,
        min_length=1,
        description="MLflow tracking server (http://HOST:PORT) or store (file:///PATH, sqlite:///PATH); default: "
        "MLflow's own ($MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working folder)",
    )
    mlflow_experiment: str = Field("scaletrain", min_length=1, description="MLflow experiment the run is logged in")
    wandb_project: str = Field("scaletrain", min_length=1, description="Weights & Biases project")
    wandb_entity: str | None = Field(None, min_length=1, description="Weights & Biases team or user; default: yours")
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        None,
        description="Weights & Biases mode; offline writes the run under the run folder's wandb/ (`wandb sync` "
        "uploads it later); default: W&B's own ($WANDB_MODE, else online)",
    )
    sample_interval_s: float = Field(
        1.0, ge=0.0, description="seconds between device samples (GPU: NVML; CPU: CPU % and RSS); 0: off"
    )
    nvtx: bool = Field(True, description="CUDA: NVTX ranges around phases, for Nsight Systems timelines")
    profile_at_step: int = Field(
        0,
        ge=0,
        le=MAX_STEPS,
        description="first step a torch.profiler window records (Chrome trace per rank in profile/); 0: off",
    )
    profile_wait: int = Field(1, ge=0, le=MAX_STEPS, description="profiler: idle steps before warmup")
    profile_warmup: int = Field(
        1, ge=0, le=MAX_STEPS, description="profiler: warm-up steps (recorded, discarded) before the window"
    )
    profile_active: int = Field(2, gt=0, le=MAX_STEPS, description="profiler: steps recorded")
    # diagnosis thresholds (percent)
    data_wait_pct: float = Field(10.0, gt=0, description="diagnosis: data-loader bound above this share of a step")
    comm_pct: float = Field(30.0, gt=0, description="diagnosis: communication bound above this share of a step")
    straggler_pct: float = Field(
        15.0, gt=0, description="diagnosis: straggler when the slowest rank is busy this much above the median"
    )
    replica_check_interval: int = Field(
        0,
        ge=0,
        le=MAX_STEPS,
        description="every N steps check that data-parallel replicas hold bit-identical weights and name a rank "
        "that does not (one small all-gather); 0: off",
    )
    straggler_ratio: float = Field(
        1.5, gt=1.0, description="a rank this many times slower than the others' median busy time is a straggler..."
    )
    straggler_steps: int = Field(
        20,
        ge=0,
        le=MAX_STEPS,
        description="...once it stays so this many consecutive steps (named in the log, "
        "metrics and diagnosis; whole logging windows); 0: off",
    )
    idle_util_pct: float = Field(30.0, gt=0, description="diagnosis: idle GPU below this median utilisation")
    bubble_excess_pct: float = Field(
        10.0, gt=0, description="diagnosis: pipeline bubble this many points above the schedule's prediction"
    )
    memory_headroom_pct: float = Field(
        50.0, gt=0, description="diagnosis: GPU memory left unused above this share suggests a bigger micro-batch"
    )
    moe_imbalance: float = Field(
        2.0, gt=1.0, description="diagnosis: an MoE whose busiest expert gets this many times its fair share of tokens"
    )

    @field_validator("trackers", mode="before")
    @classmethod
    def _trackers_list(cls, value: Any) -> Any:
        """`monitor.trackers=mlflow,wandb` on the command line (a bare word is a string) is the list it says."""
        if isinstance(value, str):
            value = [name.strip() for name in value.split(",") if name.strip()]
        if isinstance(value, list) and len(set(value)) != len(value):
            raise ValueError(f"monitor.trackers: {value} names a tracker twice; name each once")
        return value

    @model_validator(mode="after")
    def _profile_window(self) -> MonitorConfig:
        if self.profile_at_step and self.profile_at_step <= self.profile_wait + self.profile_warmup:
            raise ValueError(
                f"monitor.profile_at_step: must be > profile_wait + profile_warmup "
                f"({self.profile_wait + self.profile_warmup}) so the window fits after step 1"
            )
        return self


_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def check_endpoint(value: str) -> None:
    """HOST:PORT with a host name, IPv4 or [IPv6] address and a port 0..65535; ValueError naming
    launch.rdzv_endpoint otherwise."""
    fix = "use HOST:PORT, e.g. 127.0.0.1:0 (0 picks a free port), node1:29500 or [::1]:29500"
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"launch.rdzv_endpoint: {value!r} is not HOST:PORT; {fix}")
    if int(port) > 65535:
        raise ValueError(f"launch.rdzv_endpoint: port {int(port)} is out of range 0..65535; {fix}")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
            return
        except ValueError:
            raise ValueError(f"launch.rdzv_endpoint: {host!r} is not an IPv6 address; {fix}") from None
    if len(host) <= 253 and all(_HOST_LABEL.match(label) for label in host.removesuffix(".").split(".")):
        if not host.replace(".", "").isdigit():
            return
        try:  # all-digit dotted names must be a real IPv4 address (999.1.1.1 is not)
            ipaddress.IPv4Address(host)
            return
        except ValueError:
            pass
    raise ValueError(f"launch.rdzv_endpoint: host {host!r} is not a host name, IPv4 or [IPv6] address; {fix}")


class LaunchConfig(Section):
    nproc_per_node: int = Field(
        0, ge=0, le=MAX_RANKS, description="ranks on this host; 0: all local GPUs, or 2 CPU ranks"
    )
    nnodes: int = Field(1, gt=0, le=MAX_RANKS)
    min_nodes: int = Field(
        0,
        ge=0,
        le=MAX_RANKS,
        description="elastic: the run goes on with as few as this many nodes after one is lost (0: nnodes, not "
        "elastic); the layout is resolved again for the world that is left",
    )
    node_rank: int = Field(
        -1,
        ge=-1,
        lt=MAX_RANKS,
        description="this node's rank as the user numbers it, checked at the rendezvous (two nodes giving the "
        "same one are refused); -1: none. The c10d rendezvous orders nodes by launch.local_addr",
    )
    rdzv_endpoint: str = Field(
        "127.0.0.1:0",
        description="HOST:PORT of the c10d rendezvous (host name, IPv4 or [IPv6]); port 0 picks a "
        "free one. One host (nnodes=1): only the port is used, everything listens on 127.0.0.1",
    )
    local_addr: str = Field(
        "",
        description="nnodes > 1: this host's IP address that the other nodes reach; rank 0's store and the "
        "gloo/NCCL sockets bind to it. Empty: the address of the interface that routes to the rendezvous host",
    )
    max_restarts: int = Field(0, ge=0, le=MAX_STEPS, description="worker-group restarts by the torchrun agent")
    restart: Literal["process", "in-process"] = Field(
        "process",
        description="after a rank dies: process = the torchrun agent stops every rank and starts them again; "
        "in-process = the surviving ranks keep their processes and join a new process group with a warm spare "
        "in the dead rank's place; a rank frozen in training (SIGSTOP) is killed within seconds and replaced the "
        "same way (one node; launch.max_restarts still caps the restarts)",
    )
    fault_tolerance: Literal["none", "replicas"] = Field(
        "none",
        description="launch.restart=in-process with parallel.dp_replicate > 1 (DDP or HSDP replicas): replicas = "
        "when a rank dies, the other replicas train on without waiting (the same global batch: a larger micro-batch "
        "or more accumulation per replica) while its replica is refilled; the refilled replica takes the live state from host memory and "
        "rejoins at a step boundary (needs checkpoint.memory_interval_steps > 0); none = every rank waits",
    )
    spares: int = Field(
        1,
        ge=0,
        le=MAX_RANKS,
        description="launch.restart=in-process: processes started ahead, imported and waiting to replace a dead rank "
        "(on CPU each warms up as one rank, from the last down: as many spares as ranks cover every rank)",
    )
    collective_timeout_s: float = Field(
        600.0,
        gt=0,
        le=MAX_SECONDS,
        description="process-group timeout for a collective; also the hang limit until step 1 is done",
    )
    hang_timeout_s: float = Field(
        300.0,
        ge=0,
        le=MAX_SECONDS,
        description="after step 1: a rank without progress this long names the stuck "
        "rank and exits 124 (0: no watchdog)",
    )
    shutdown_timeout_s: int = Field(
        30,
        gt=0,
        le=MAX_SECONDS,
        description="the agent's grace between SIGTERM and SIGKILL when it stops workers "
        "(they save a checkpoint in it when preempted)",
    )

    @field_validator("rdzv_endpoint")
    @classmethod
    def _host_port(cls, value: str) -> str:
        check_endpoint(value)
        return value

    @model_validator(mode="after")
    def _node_counts(self) -> LaunchConfig:
        if self.min_nodes > self.nnodes:
            raise ValueError(f"launch.min_nodes: {self.min_nodes} is more than launch.nnodes={self.nnodes}")
        if self.node_rank >= self.nnodes:
            raise ValueError(
                f"launch.node_rank: {self.node_rank} is not below launch.nnodes={self.nnodes}; number nodes 0..N-1"
            )
        return self


class LoraConfig(Section):
    """Low-rank adapters (peft's LoRA) on a frozen base; rank 0 (the default) trains every weight."""

    rank: int = Field(0, ge=0, le=65536, description="adapter rank r; 0: LoRA off, full fine-tuning")
    alpha: int = Field(
        16, ge=1, le=65536, description="scaling numerator (peft's lora_alpha): adapters add (alpha / rank) * B @ A x"
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapters' input (0: deterministic)")
    targets: list[str] | None = Field(
        None,
        description="module-name suffixes to adapt (peft's target_modules); default: the family's attention and "
        "MLP projections",
    )
    quantize: Literal["none", "nf4"] = Field(
        "none",
        description="the adapted layers' frozen base weights: 'nf4' stores them in QLoRA's 4-bit NormalFloat "
        "(torchao's NF4Tensor, the qlora extra), sharded by FSDP2; 'none' keeps them in the model's dtype",
    )


class JobConfig(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)

    @model_validator(mode="after")
    def _in_process_restart_on_one_node(self) -> JobConfig:
        if self.launch.restart == "in-process" and self.launch.nnodes > 1:
            raise ValueError(
                f"launch.restart: in-process restart works on one node (launch.nnodes={self.launch.nnodes}); "
                f"set launch.restart=process"
            )
        return self

    @model_validator(mode="after")
    def _replica_fault_tolerance(self) -> JobConfig:
        if self.launch.fault_tolerance != "replicas":
            return self
        if self.launch.restart != "in-process":
            raise ValueError(
                "launch.fault_tolerance: replicas works with in-process restarts; set launch.restart=in-process"
            )
        if self.parallel.dp_replicate < 2:
            raise ValueError(
                f"launch.fault_tolerance: replicas needs at least 2 data-parallel replicas (parallel.dp_replicate="
                f"{self.parallel.dp_replicate}); set parallel.dp_replicate=2 or more (DDP, or HSDP with dp_shard)"
            )
        if not self.checkpoint.memory_interval_steps:
            raise ValueError(
                "launch.fault_tolerance: replicas hands a rejoining replica the live state through host memory; "
                "set checkpoint.memory_interval_steps (e.g. 10)"
            )
        return self

    def with_replicas(self, replicas: int) -> JobConfig:
        """This job on `replicas` of its parallel.dp_replicate replicas (launch.fault_tolerance=replicas): the same
        global batch and schedule, each replica the same ranks."""
        return self.model_copy(update={"parallel": self.parallel.model_copy(update={"dp_replicate": replicas})})

    @model_validator(mode="after")
    def _memory_snapshots_on_one_node(self) -> JobConfig:
        if self.checkpoint.memory_interval_steps and self.launch.nnodes > 1:
            raise ValueError(
                f"checkpoint.memory_interval_steps: host-memory snapshots work on one node (launch.nnodes="
                f"{self.launch.nnodes}): their copy on a peer node is not built yet; set it to 0"
            )
        return self

    def run_dir(self) -> Path:
        """The run's folder, run.output_dir/run.name: config, metrics, logs, checkpoints (relative to the cwd when
        output_dir is)."""
        return Path(self.run.output_dir) / self.run.name
