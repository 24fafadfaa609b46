"""MFU: model FLOPs per second achieved / peak FLOP/s of the devices the job runs on.

Convention: the model's `flops_per_token(seq_len)` (for the built-in Llama: 6·N non-embedding parameters plus
12·L·h·s attention, PaLM appendix B), times tokens/s of the whole job, over world size × one device's dense peak
for the compute dtype from the hardware catalog (bf16 peak for bf16/fp16, plain fp32 peak for fp32). Activation
recomputation is not counted (that would be HFU). CPU ranks share one host: the catalog's `cpu` entry is a
host-wide placeholder, so the peak there is hosts × that figure and MFU is only comparable run to run.
"""

from __future__ import annotations

import os

import torch

from scaletrain.config.precisions import precision
from scaletrain.hardware.catalog import GPUS
from scaletrain.hardware.detect import catalog_name_for


def peak_flops(device: torch.device, dtype: str, world_size: int) -> tuple[float | None, str]:
    """(peak FLOP/s of the whole job, the catalog entry and figure used); None when the catalog has no match."""
    if device.type == "cuda":
        name = catalog_name_for(torch.cuda.get_device_name(device))
        per_device, count = True, world_size
    else:
        name = "cpu"
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)
        per_device, count = False, max(world_size // max(local, 1), 1)
    if name is None or name not in GPUS:
        return None, f"no catalog entry for {torch.cuda.get_device_name(device)}"
    spec = GPUS[name]
    figure = precision(dtype).datasheet_rate
    flops = spec.bf16_flops if figure == "bf16" else spec.fp32_flops
    what = f"{count} x {name} {figure} {flops / 1e12:g} TFLOP/s" + ("" if per_device else " (host-wide placeholder)")
    return flops * count, f"{what}; source: {spec.sources.get(figure, 'catalog')}"
