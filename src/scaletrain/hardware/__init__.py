"""Hardware: the catalog of GPUs and links with sourced figures, cluster files, host detection, calibration."""

from scaletrain.hardware.calibration import Calibration, CalibrationError, apply_calibration, load_calibration
from scaletrain.hardware.catalog import GPUS, LINKS, GPUSpec, LinkSpec, get_gpu, get_link
from scaletrain.hardware.cluster import Cluster, ClusterFileError, load_cluster, make_cluster
from scaletrain.hardware.detect import HostInfo, detect_host

__all__ = [
    "GPUS",
    "LINKS",
    "Calibration",
    "CalibrationError",
    "Cluster",
    "ClusterFileError",
    "GPUSpec",
    "HostInfo",
    "LinkSpec",
    "apply_calibration",
    "detect_host",
    "get_gpu",
    "get_link",
    "load_calibration",
    "load_cluster",
    "make_cluster",
]
