"""Device sampling off the hot path: a daemon thread per rank writes one JSON line every `interval_s`.

On a GPU (NVML through nvidia-ml-py): utilisation %, memory used/total (bytes), power (W), temperature (°C), SM and
memory clocks (MHz) of this rank's device. On a CPU host: this process's CPU % (100 = one core busy), the host's
CPU % (all cores) and this process's resident set (bytes) — records carry `"kind": "cpu"` so nobody mistakes them
for GPU figures.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any
from pathlib import Path

import torch


def _nvml_handle(device: torch.device):
    import pynvml  # from nvidia-ml-py

    pynvml.nvmlInit()
    props: Any = torch.cuda.get_device_properties(device)  # pci_* fields are missing from torch's stubs
    try:  # PCI bus id survives CUDA_VISIBLE_DEVICES renumbering; the index does not
        bus = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
        return pynvml, pynvml.nvmlDeviceGetHandleByPciBusId(bus)
    except Exception:  # noqa: BLE001 - older drivers/props: fall back to the index
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)


class DeviceSampler:
    def __init__(self, path: Path, rank: int, device: torch.device, interval_s: float, t0: float, append: bool = False):
        """t0: Unix seconds the samples' `t` counts from (the run's start, so a resumed run's samples go on from
        the first attempt's); append: continue the file (a resumed run) instead of starting it anew."""
        self.path, self.rank, self.device, self.interval_s = path, rank, device, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"scaletrain-sampler-{rank}", daemon=True)
        self._t0, self._mode = t0, "a" if append else "w"

    def start(self) -> DeviceSampler:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def _gpu_reader(self):
        nv, h = _nvml_handle(self.device)

        def read() -> dict:
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            return {
                "kind": "gpu",
                "util_pct": float(nv.nvmlDeviceGetUtilizationRates(h).gpu),
                "mem_used_bytes": float(mem.used),
                "mem_total_bytes": float(mem.total),
                "power_w": nv.nvmlDeviceGetPowerUsage(h) / 1e3,
                "temp_c": float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
                "sm_clock_mhz": float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
                "mem_clock_mhz": float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)),
            }

        return read

    def _cpu_reader(self):
        import psutil

        proc = psutil.Process()
        proc.cpu_percent(None)  # the first call only starts the interval
        psutil.cpu_percent(None)

        def read() -> dict:
            return {
                "kind": "cpu",
                "process_cpu_pct": proc.cpu_percent(None),
                "host_cpu_pct": psutil.cpu_percent(None),
                "rss_bytes": float(proc.memory_info().rss),
            }

        return read

    def _run(self) -> None:
        try:
            read = self._gpu_reader() if self.device.type == "cuda" else self._cpu_reader()
        except Exception as e:  # noqa: BLE001 - sampling is best effort; training must not stop for it
            from scaletrain.monitor.progress import log

            log.warning("rank %d: device sampling off (%s)", self.rank, e)
            return
        with open(self.path, self._mode, buffering=1) as f:
            while not self._stop.wait(self.interval_s):
                try:
                    rec = {"t": round(time.time() - self._t0, 3), "rank": self.rank, **read()}
                except Exception:  # noqa: BLE001
                    continue
                f.write(json.dumps(rec) + "\n")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
