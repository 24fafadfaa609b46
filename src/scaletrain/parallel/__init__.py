"""Device mesh and layouts: DDP, FSDP2, HSDP, tensor + sequence parallel, pipeline parallel, activation
checkpointing and compile, applied in one fixed order (see apply.py)."""

from scaletrain.parallel.apply import ParallelModel, ParallelPlan, apply_parallelism
from scaletrain.parallel.dims import build_mesh, dp_coordinates
from scaletrain.parallel.runtime import Runtime, init_distributed, pick_device_type, shutdown_distributed
from scaletrain.parallel.state import full_state_dict

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
