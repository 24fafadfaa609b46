"""What the planner plans for (a Workload) and what it proposes (a Layout), plus the columns of many layouts at
once (LayoutGrid) that the memory and time models evaluate in one vectorised pass."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from scaletrain.models.spec import DecoderShape

AC_MODES = ("none", "selective", "full")
PRECISIONS = ("bf16", "fp16", "fp32")
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Workload:
    """A model and the batch it trains on: global_batch sequences of seq_len tokens per optimizer step."""

    model_name: str
    args: DecoderShape
    seq_len: int
    global_batch: int

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
        if self.dp_shard > 1:
            return "hsdp" if self.dp_replicate > 1 else "fsdp"
        return "ddp" if self.dp_replicate > 1 else "single"

    def describe(self) -> str:
        """Short human form, e.g. 'fsdp 64 · mb 1×8 · ac full · bf16'."""
        parts = []
        if self.dp_shard > 1 and self.dp_replicate > 1:
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

    def to_overrides(self) -> str:
        """The job-config overrides that run this layout (`scaletrain train CONFIG.toml <these>`).

        parallel.cp has no trainer behind it yet (the config refuses it); `--plan auto` never searches cp > 1.
        Stages per rank are the schedule's default (parallel.pp_stages_per_rank), as the planner assumes.
        """
        out = [f"parallel.dp_replicate={self.dp_replicate}", f"parallel.dp_shard={self.dp_shard}",
               f"parallel.tp={self.tp}", f"parallel.pp={self.pp}"]
        if self.cp > 1:
            out.append(f"parallel.cp={self.cp}")
        if self.pp > 1:
            out.append(f"parallel.pp_schedule={self.schedule}")
        if self.ac != "none":
            out.append(f"parallel.activation_checkpoint={self.ac}")
        out.append(f"train.global_batch_size={self.micro_batch * self.accumulation * self.dp}")
        out.append(f"train.micro_batch_size={self.micro_batch}")
        out.append(f"precision.dtype={self.precision}")
        return " ".join(out)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["world_size"] = self.world_size
        d["overrides"] = self.to_overrides()
        return d


@dataclass
class LayoutGrid:
    """Many layouts as equal-length integer columns; ac, precision and schedule are indices into AC_MODES,
    PRECISIONS and pipeline.SCHEDULES."""

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
        from scaletrain.plan.pipeline import SCHEDULES

        g = {f.name: int(getattr(self, f.name)[i]) for f in fields(self)}
        return Layout(g["dp_replicate"], g["dp_shard"], g["tp"], g["pp"], g["cp"], g["micro_batch"],
                      g["accumulation"], AC_MODES[g["ac"]], PRECISIONS[g["precision"]],
                      SCHEDULES[g["schedule"]].name, g["virtual_stages"])

    @classmethod
    def of(cls, layouts: list[Layout]) -> LayoutGrid:
        """A grid of the given layouts (to evaluate a few by hand)."""
        from scaletrain.plan.pipeline import schedule_index

        cols = {f.name: [] for f in fields(cls)}
        for lay in layouts:
            for name in cols:
                value = getattr(lay, name)
                if name == "ac":
                    value = AC_MODES.index(value)
                elif name == "precision":
                    value = PRECISIONS.index(value)
                elif name == "schedule":
                    value = schedule_index(value)
                cols[name].append(value)
        return cls(**{k: np.asarray(v, dtype=np.int64) for k, v in cols.items()})
