"""Device mesh and layouts: DDP, FSDP2, HSDP, tensor + sequence parallel, pipeline parallel, activation
checkpointing and compile, applied in one fixed order (see apply.py).

The names below are imported on first use: the command reads the torch-free modules of this package (rank_env,
network) before it imports torch, and importing them must not import the layouts (torch, DTensor and sympy: ~3 s of
CPU in every `scaletrain train` before its ranks start)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scaletrain.parallel.apply import ParallelModel, ParallelPlan, apply_parallelism
    from scaletrain.parallel.dims import build_mesh, dp_coordinates
    from scaletrain.parallel.runtime import Runtime, init_distributed, pick_device_type, shutdown_distributed
    from scaletrain.parallel.state import full_state_dict

_HOMES = {
    "ParallelModel": "apply",
    "ParallelPlan": "apply",
    "apply_parallelism": "apply",
    "build_mesh": "dims",
    "dp_coordinates": "dims",
    "Runtime": "runtime",
    "init_distributed": "runtime",
    "pick_device_type": "runtime",
    "shutdown_distributed": "runtime",
    "full_state_dict": "state",
}

__all__ = [
    "ParallelModel",
    "ParallelPlan",
    "Runtime",
    "apply_parallelism",
    "build_mesh",
    "dp_coordinates",
    "full_state_dict",
    "init_distributed",
    "pick_device_type",
    "shutdown_distributed",
]


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'scaletrain.parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(f"scaletrain.parallel.{home}"), name)
