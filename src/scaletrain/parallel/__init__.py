"""Device mesh and layouts: DDP, FSDP2, HSDP, applied in one fixed order."""

from scaletrain.parallel.apply import apply_parallelism
from scaletrain.parallel.dims import ParallelDims, build_mesh, dp_coordinates
from scaletrain.parallel.runtime import Runtime, init_distributed, pick_device_type, shutdown_distributed

__all__ = ["ParallelDims", "Runtime", "apply_parallelism", "build_mesh", "dp_coordinates", "init_distributed",
           "pick_device_type", "shutdown_distributed"]
