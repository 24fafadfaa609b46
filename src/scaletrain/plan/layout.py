"""What the planner plans for (a Workload), and the columns of many layouts at once (LayoutGrid) that the memory and
time models evaluate in one vectorised pass; each row is a config.layout.Layout, the type the trainer runs."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from scaletrain.config.layout import AC_MODES, Layout
from scaletrain.config.precisions import PRECISION_NAMES
from scaletrain.models.spec import DecoderShape
from scaletrain.plan.lora import LoraShape


def runs_compiled(compile_asked: bool, fp8: str, gpu: str) -> bool:
    """Whether the trainer runs the blocks compiled, for the planner to price them so: asked for, or fp8 on a GPU
    (resolve/device.py settle_device_defaults compiles it there and refuses eager fp8)."""
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
    # data.packing=document on a per-document attention kernel (flex_attention block masks): the mean document
    # length in tokens; a query then attends within its document, so attention costs per document, not per row.
    # None: every query sees its row (concat, pad)
    doc_len: int | None = None
    # lora.rank > 0: a frozen base (fp32 weights, no gradients, no optimizer states) with trained adapters
    # (plan/lora.py); None: full fine-tuning, every weight trained
    lora: LoraShape | None = None

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch

    @property
    def attention_len(self) -> int:
        """Tokens the causal attention of one query spans on average x 2 (the `s` of 12·L·h·s): the row's
        seq_len, or the mean document length when documents are packed with per-document attention."""
        return min(self.doc_len, self.seq_len) if self.doc_len else self.seq_len

    @property
    def model_flops_per_token(self) -> float:
        """Training FLOPs per token, PaLM appendix B convention: 6N + 12·L·h·s (as DecoderShape.flops_per_token),
        s the attention span (attention_len)."""
        return self.args.flops_per_token(self.attention_len)


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

    @property
    def sharded(self) -> np.ndarray:
        """Rows whose data parallelism is FSDP or HSDP: DataParallelMode.of, one column at a time."""
        return self.dp_shard * self.cp > 1

    @property
    def ddp(self) -> np.ndarray:
        """Rows whose data parallelism is DDP (replicas, nothing sharded): DataParallelMode.of, one column at a time."""
        return ~self.sharded & (self.dp_replicate > 1)

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
