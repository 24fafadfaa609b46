"""What this host has: CPUs, memory, CUDA GPUs (through torch), nvidia-smi, InfiniBand ports.

Honest on a CPU host: no GPU is reported as none, not guessed.
"""

from __future__ import annotations

import os
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path

# CUDA device names (as torch reports them) -> catalog entries; first match wins
_NAME_MAP = (
    ("H200", "h200"),
    ("H100 PCIe", "h100-pcie"),
    ("H100", "h100-sxm"),
    ("B200", "b200"),
    ("A100-SXM4-40GB", "a100-40gb"),
    ("A100-PCIE-40GB", "a100-40gb"),
    ("A100", "a100-80gb"),
    ("L40S", "l40s"),
    ("RTX 4090", "rtx-4090"),
)


@dataclass(frozen=True)
class HostInfo:
    hostname: str
    cpu_count: int
    memory_bytes: float | None  # host RAM, bytes
    gpu_names: tuple[str, ...] = ()
    gpu_memory_bytes: tuple[int, ...] = ()
    catalog_gpu: str = "cpu"  # the catalog entry this host's devices match ("cpu" without GPUs)
    nvidia_smi: str | None = None
    infiniband: tuple[str, ...] = field(default_factory=tuple)

    @property
    def gpu_count(self) -> int:
        return len(self.gpu_names)

    def describe(self) -> str:
        if not self.gpu_names:
            mem = f", {self.memory_bytes / 1e9:.1f} GB RAM" if self.memory_bytes else ""
            return f"{self.hostname}: no CUDA GPU; {self.cpu_count} CPU cores{mem}"
        return f"{self.hostname}: {self.gpu_count} x {self.gpu_names[0]} ({self.catalog_gpu})"


def host_memory_bytes() -> float | None:
    """Total RAM from /proc/meminfo, bytes (None where that file does not exist)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def catalog_name_for(device_name: str) -> str | None:
    """The catalog entry for a CUDA device name, or None when the catalog has no match."""
    for needle, name in _NAME_MAP:
        if needle.lower() in device_name.lower():
            return name
    return None


def detect_host() -> HostInfo:
    """Inspect this host without starting any process group."""
    import torch

    names, mems = [], []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            names.append(props.name)
            mems.append(props.total_memory)
    ib_dir = Path("/sys/class/infiniband")
    ib = tuple(sorted(p.name for p in ib_dir.iterdir())) if ib_dir.is_dir() else ()
    catalog = (catalog_name_for(names[0]) or "unknown") if names else "cpu"
    return HostInfo(
        socket.gethostname(),
        os.cpu_count() or 1,
        host_memory_bytes(),
        tuple(names),
        tuple(mems),
        catalog,
        shutil.which("nvidia-smi"),
        ib,
    )
