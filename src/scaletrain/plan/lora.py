"""LoRA as the planner counts it (`plan --lora-rank R`, `[lora]` of a job config): the frozen base keeps its fp32
weights but no gradients and no AdamW states; each adapted linear W (out x in) gains peft's lora_A (rank x in) and
lora_B (out x rank), fp32, which alone get gradients and optimizer states (models/lora.py). Adapters sit on the
block's projections only (never the embedding or the output layer), so a rank holds its blocks' adapters.

QLoRA (lora.quantize='nf4', `plan --lora-quantize nf4`): the adapted projections' base weights are torchao NF4
tensors: per weight a 4-bit code and an int8 scale per 64, per 256 scales one scale in the base's dtype (fp32), and
per tensor (each FSDP2 shard is one) its scales' mean and the 16-entry NF4 table (nf4_bytes: exact, tested against
the trainer's tensors). FSDP2 gathers them 4-bit; the forward dequantizes one weight at a time. No TP (refused).

Sharding follows the base layer (torchtitan's LoRA): under tensor parallelism a column-parallel base (q, k, v, gate,
up) keeps lora_A whole and splits lora_B's rows; a row-parallel base (o, down) splits lora_A's columns and keeps
lora_B whole. FSDP2 shards dim 0 of every adapter like any weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scaletrain.models.lora import NF4_BLOCK, NF4_GRANULE, whole_nf4_shards
from scaletrain.models.spec import DecoderShape
from scaletrain.plan.shapes import _shard_rows, layer_param_shapes

# target module names of the families (built-in Llama, Hugging Face) -> the planner's name of that linear
PLAN_NAME = {
    "wq": "q",
    "wk": "k",
    "wv": "v",
    "wo": "o",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
    "q_proj": "q",
    "k_proj": "k",
    "v_proj": "v",
    "o_proj": "o",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
}
COLUMN_PARALLEL = ("q", "k", "v", "gate", "up")  # parallel/tensor_parallel.py: output rows split
ROW_PARALLEL = ("o", "down")  # input columns split


@dataclass(frozen=True)
class LoraShape:
    """What the planner needs of `[lora]`: the rank and which of the block's linears are adapted (planner names)."""

    rank: int
    targets: tuple[str, ...] = COLUMN_PARALLEL + ROW_PARALLEL  # the families' default: attention and MLP
    dropout: bool = False  # lora.dropout > 0: each adapter keeps a dropped-out copy of its input
    quantize: bool = False  # lora.quantize='nf4': the adapted projections' base is 4-bit (QLoRA)

    def describe(self) -> str:
        base = " (4-bit NF4 base)" if self.quantize else ""
        return f"LoRA rank {self.rank} on {', '.join(self.targets)}{base}"


def lora_shape(rank: int, targets: list[str] | None = None, dropout: float = 0.0, quantize: str = "none") -> LoraShape:
    """The planner's LoraShape of lora.rank / lora.targets (None: the families' default projections) /
    lora.dropout / lora.quantize; ValueError naming lora.targets for a module the planner cannot place."""
    if targets is None:
        return LoraShape(rank, dropout=dropout > 0, quantize=quantize == "nf4")
    names = []
    for t in targets:
        name = PLAN_NAME.get(t.rsplit(".", 1)[-1], t)
        if name not in COLUMN_PARALLEL + ROW_PARALLEL:
            raise ValueError(
                f"lora.targets: the planner knows no block linear {t!r}; name projections ({', '.join(PLAN_NAME)})"
            )
        if name not in names:
            names.append(name)
    return LoraShape(rank, tuple(names), dropout > 0, quantize == "nf4")


def _adapted_linears(args: DecoderShape, lora: LoraShape) -> list[tuple[str, tuple[int, ...]]]:
    """(planner name, (rows, cols)) of one block's adapted linears (a target the block lacks, the GPT block's gate,
    left out)."""
    linears = dict(layer_param_shapes(args))
    return [(name, linears[name]) for name in lora.targets if name in linears]


def adapter_shapes(args: DecoderShape, lora: LoraShape) -> list[tuple[str, str, tuple[int, int]]]:
    """(base linear, lora_A|lora_B, shape) of one block's adapters."""
    out = []
    for name, (rows, cols) in _adapted_linears(args, lora):
        out.append((name, "lora_A", (lora.rank, cols)))
        out.append((name, "lora_B", (rows, lora.rank)))
    return out


def nf4_bytes(numel: float, elem_bytes: float = 4.0) -> float:
    """Bytes of one NF4 tensor of `numel` weights over a base of `elem_bytes` (torchao's NF4Tensor: 4-bit codes,
    an int8 scale per 64 codes, a scale per 256 scales, the scales' mean and the 16-value table)."""
    return numel / 2 + numel / NF4_BLOCK + (numel / NF4_GRANULE + 17) * elem_bytes


def nf4_shards_whole(args: DecoderShape, lora: LoraShape, shards: int) -> bool:
    """Whether each adapted projection's rows split evenly into `shards` FSDP2 shards of whole NF4 blocks (the
    trainer's check, models/lora.py check_quantize); always true without lora.quantize."""
    return not lora.quantize or all(
        whole_nf4_shards(rows, cols, shards) for _, (rows, cols) in _adapted_linears(args, lora)
    )


def layer_quantized(args: DecoderShape, lora: LoraShape, dp_shard: int = 1) -> tuple[int, float, int]:
    """(elements, bytes, largest whole weight's elements) of one block's 4-bit base weights on the largest rank
    after FSDP2 dim-0 sharding; zeros without lora.quantize."""
    if not lora.quantize:
        return 0, 0.0, 0
    numel, size, largest = 0, 0.0, 0
    for _, (rows, cols) in _adapted_linears(args, lora):
        local = _shard_rows(rows, dp_shard) * cols
        numel, size, largest = numel + local, size + nf4_bytes(local), max(largest, rows * cols)
    return numel, size, largest


def layer_adapter_params(args: DecoderShape, lora: LoraShape, tp: int = 1, dp_shard: int = 1) -> tuple[int, int]:
    """(adapter elements, adapter tensors) of one block on the largest rank after TP and FSDP2 dim-0 sharding."""
    numel = 0
    shapes = adapter_shapes(args, lora)
    for base, kind, (rows, cols) in shapes:
        if tp > 1 and kind == "lora_B" and base in COLUMN_PARALLEL:
            rows = -(-rows // tp)
        if tp > 1 and kind == "lora_A" and base in ROW_PARALLEL:
            cols = -(-cols // tp)
        if dp_shard > 1:
            rows = _shard_rows(rows, dp_shard)
        numel += math.prod((rows, cols))
    return numel, len(shapes)


def adapter_params(args: DecoderShape, lora: LoraShape) -> int:
    """Every adapter element of the model (one replica)."""
    return args.n_layers * layer_adapter_params(args, lora)[0]


def adapter_activation_bytes_per_token(args: DecoderShape, lora: LoraShape, elem_bytes, tp=1):
    """Bytes the adapters add to what one block saves for backward, per token: lora_B's input (rank elements per
    adapted linear; lora_A's input is the base layer's, already kept); with lora.dropout, also lora_A's own
    dropped-out copy of the input and its 1-byte mask (a row-parallel input is split by TP)."""
    import numpy as np

    e = np.asarray(elem_bytes, dtype=np.float64)
    t = np.asarray(tp, dtype=np.float64)
    out = np.zeros_like(e * t)
    for base, kind, (_, cols) in adapter_shapes(args, lora):
        if kind == "lora_A":
            out = out + e * lora.rank
            if lora.dropout:
                out = out + (e + 1.0) * (cols / t if base in ROW_PARALLEL else cols)
    return out
