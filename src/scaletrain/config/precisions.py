"""The compute precisions scaletrain runs, each with the properties the config, the trainer and the planner decide
by. The one list: precision.dtype's choices, the trainer's torch dtypes and loss scaling, and the planner's bytes and
peak rates all derive from PRECISIONS. Pure Python, no torch (the config imports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Precision:
    """One compute dtype (weights and optimizer states stay fp32 whatever it is)."""

    name: str  # as precision.dtype takes it
    element_bytes: int
    torch_dtype: str  # attribute of the torch module: torch.bfloat16
    loss_scaling: bool  # its narrow exponent range needs a gradient scaler (GradScaler)
    gradient_reduction: bool  # offered as precision.reduce_dtype (fp16 sums of scaled gradients overflow)
    datasheet_rate: Literal["bf16", "fp32"]  # which peak of the GPU catalog applies (fp16 runs at the bf16 rate)


PRECISIONS: tuple[Precision, ...] = (
    Precision("fp32", 4, "float32", loss_scaling=False, gradient_reduction=True, datasheet_rate="fp32"),
    Precision("bf16", 2, "bfloat16", loss_scaling=False, gradient_reduction=True, datasheet_rate="bf16"),
    Precision("fp16", 2, "float16", loss_scaling=True, gradient_reduction=False, datasheet_rate="bf16"),
)
PRECISION_NAMES: tuple[str, ...] = tuple(p.name for p in PRECISIONS)
REDUCE_DTYPES: tuple[str, ...] = tuple(p.name for p in PRECISIONS if p.gradient_reduction)
PrecisionName = Literal[PRECISION_NAMES]  # type: ignore[valid-type]
# precision.dtype also takes "auto": decided per device by resolve_dtype
AUTO_DTYPE = "auto"
DtypeSetting = Literal[(AUTO_DTYPE, *PRECISION_NAMES)]  # type: ignore[valid-type]
# the dtype master weights, gradients and optimizer states are kept in
MASTER_DTYPE = "fp32"
_BY_NAME = {p.name: p for p in PRECISIONS}


def precision(name: str) -> Precision:
    """The precision called `name`; ValueError lists the names."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose from {', '.join(PRECISION_NAMES)}") from None


def resolve_dtype(setting: str, fp8: str, device_type: str, bf16_supported: bool) -> str:
    """The compute dtype precision.dtype=`setting` means on this device: itself, unless it is "auto": bf16 when fp8
    is on (fp8 runs on top of bf16) or on a GPU with bf16 arithmetic (compute capability 8.0+), fp32 otherwise (a
    CPU has no faster bf16 matmuls, and fp32 keeps the CPU parity tests exact)."""
    if setting != AUTO_DTYPE:
        return setting
    if fp8 != "none" or (device_type == "cuda" and bf16_supported):
        return "bf16"
    return "fp32"
