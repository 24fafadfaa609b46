"""What the planner plans for (a Workload) and what it proposes (a Layout, which applies itself to a JobConfig),
plus the columns of many layouts at once (LayoutGrid) that the memory and time models evaluate in one vectorised
pass."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from scaletrain.config import JobConfig, validate_config
from scaletrain.config.precisions import PRECISION_NAMES
from scaletrain.models.spec import DecoderShape

AC_MODES = ("none", "selective", "full")


def runs_compiled(compile_asked: bool, fp8: str, gpu: str) -> bool:
    """Whether the trainer runs the blocks compiled, for the planner to price them so: asked for, or fp8 on a GPU
    (train/preflight.py settle_device_defaults compiles it there and refuses eager fp8)."""
    return compile_asked or (fp8 != "none" and gpu != "cpu")


@dataclass(frozen=True)
class Workload:
    """A model and the batch it trains on: global_batch sequences of seq_len tokens per optimizer step."""

    model_name: str
    args: DecoderShape
    seq_len: int
    global_batch: int
    # precision.fp8 of the job: the blocks' matmuls of bf16 layouts run at the GPU's fp8 rate (plan/steptime.py)
    fp8: str = "none"
    # parallel.compile: Inductor fuses each block's memory-bound ops and launches its kernels from generated code
    # (no per-op dispatch; plan/steptime.py)
    compile: bool = False

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch

    @property
    def model_flops_per_token(self) -> float:
        """Training FLOPs per token, PaLM appendix B convention: 6N + 12·L·h·s (as DecoderShape.flops_per_token)."""
        return self.args.flops_per_token(self.seq_len)


@dataclass(frozen=True)
class Layout:
    """One way to run the workload. world size = dp_replicate x dp_shard x cp x tp x pp."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    micro_batch: int
    accumulation: int  # micro-batches per optimizer step per data-parallel rank
    ac: str  # activation checkpointing: none / selective / full
    precision: str
    schedule: str  # pipeline schedule ("none" when pp == 1)
    virtual_stages: int = 1  # stages per rank (interleaved and V schedules)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def data_parallel_mode(self) -> str:
        if self.dp_shard * self.cp > 1:  # cp ranks join the FSDP shard group, as in the trainer
            return "hsdp" if self.dp_replicate > 1 else "fsdp"
        return "ddp" if self.dp_replicate > 1 else "single"

    def describe(self) -> str:
        """Short human form, e.g. 'fsdp 64 · mb 1×8 · ac full · bf16'."""
        parts = []
        if self.dp_shard * self.cp > 1 and self.dp_replicate > 1:
            parts.append(f"hsdp {self.dp_replicate}x{self.dp_shard}")
        elif self.dp_shard > 1:
            parts.append(f"fsdp {self.dp_shard}")
        elif self.dp_replicate > 1:
            parts.append(f"ddp {self.dp_replicate}")
        if self.tp > 1:
            parts.append(f"tp {self.tp}")
        if self.cp > 1:
            parts.append(f"cp {self.cp}")
        if self.pp > 1:
            v = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
            parts.append(f"pp {self.pp} {self.schedule}{v}")
        if not parts:
            parts.append("1 gpu")
        parts.append(f"mb {self.micro_batch}x{self.accumulation}")
        parts.append(f"ac {self.ac}")
        parts.append(self.precision)
        return " · ".join(parts)

    def settings(self) -> dict[str, dict[str, object]]:
        """The job-config values that run this layout, by section and key (typed, as JobConfig holds them).

        Sequence parallelism comes with tp > 1 (the planner's TP model assumes it); cp > 1 runs the all-gather
        method (parallel.cp_method=allgather), the one the planner's cp traffic models. Stages per rank are the
        schedule's default (parallel.pp_stages_per_rank), as the planner assumes.
        """
        parallel: dict[str, object] = {
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "tp": self.tp,
            "pp": self.pp,
        }
        if self.cp > 1:
            parallel["cp"] = self.cp
            parallel["cp_method"] = "allgather"
        if self.pp > 1:
            parallel["pp_schedule"] = self.schedule
        if self.ac != "none":
            parallel["activation_checkpoint"] = self.ac
        if self.tp > 1:
            parallel["sequence_parallel"] = True
        return {
            "parallel": parallel,
            "train": {
                "global_batch_size": self.micro_batch * self.accumulation * self.dp,
                "micro_batch_size": self.micro_batch,
            },
            "precision": {"dtype": self.precision},
        }

    def apply(self, cfg: JobConfig) -> JobConfig:
        """`cfg` running this layout: its settings() replace cfg's, everything else stays. ConfigError (one line
        naming the field) when the result is not a valid config."""
        tree = cfg.model_dump()
        for section, values in self.settings().items():
            tree[section].update(values)
        return validate_config(tree)

    def as_overrides(self) -> str:
        """The same settings as `key=value` overrides, for people to read or paste
        (`scaletrain train CONFIG.toml <these>`); scaletrain itself applies a Layout with apply()."""

        def toml(value: object) -> str:
            return str(value).lower() if isinstance(value, bool) else str(value)

        return " ".join(
            f"{section}.{key}={toml(value)}"
            for section, values in self.settings().items()
            for key, value in values.items()
        )

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["world_size"] = self.world_size
        d["overrides"] = self.as_overrides()
        return d


@dataclass
class LayoutGrid:
    """Many layouts as equal-length integer columns; ac and precision are indices into AC_MODES and
    config.precisions.PRECISION_NAMES, schedule a code of plan.pipeline (0: no pipeline, then the registry's)."""

    dp_replicate: np.ndarray
    dp_shard: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    cp: np.ndarray
    micro_batch: np.ndarray
    accumulation: np.ndarray
    ac: np.ndarray
    precision: np.ndarray
    schedule: np.ndarray
    virtual_stages: np.ndarray

    def __len__(self) -> int:
        return len(self.tp)

    @property
    def dp(self) -> np.ndarray:
        return self.dp_replicate * self.dp_shard

    def take(self, index) -> LayoutGrid:
        return LayoutGrid(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def row(self, i: int) -> Layout:
        from scaletrain.plan.pipeline import CODE_NAMES

        g = {f.name: int(getattr(self, f.name)[i]) for f in fields(self)}
        return Layout(
            g["dp_replicate"],
            g["dp_shard"],
            g["tp"],
            g["pp"],
            g["cp"],
            g["micro_batch"],
            g["accumulation"],
            AC_MODES[g["ac"]],
            PRECISION_NAMES[g["precision"]],
            CODE_NAMES[g["schedule"]],
            g["virtual_stages"],
        )

    @classmethod
    def of(cls, layouts: list[Layout]) -> LayoutGrid:
        """A grid of the given layouts (to evaluate a few by hand)."""
        from scaletrain.plan.pipeline import schedule_code

        cols: dict[str, list] = {f.name: [] for f in fields(cls)}
        for lay in layouts:
            for name in cols:
                value = getattr(lay, name)
                if name == "ac":
                    value = AC_MODES.index(value)
                elif name == "precision":
                    value = PRECISION_NAMES.index(value)
                elif name == "schedule":
                    value = schedule_code(value)
                cols[name].append(value)
        return cls(**{k: np.asarray(v, dtype=np.int64) for k, v in cols.items()})
