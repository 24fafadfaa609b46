"""Job resolution, the layer below the trainer, the planner and the command line: `resolve_job(cfg, world)` checks a
config against a world size and returns the ResolvedJob (model spec and Layout); `settle_device_defaults` decides
the device-dependent "auto" settings first."""

from scaletrain.resolve.device import default_nproc, settle_device_defaults
from scaletrain.resolve.job import ResolvedJob, resolve_job

__all__ = ["ResolvedJob", "default_nproc", "resolve_job", "settle_device_defaults"]
