"""MFU: model FLOPs per second achieved / peak FLOP/s of the devices the job runs on — only from a peak that is known.

Convention: the model's `flops_per_token(seq_len)` (for the built-in Llama: 6·N non-embedding parameters plus
12·L·h·s attention, PaLM appendix B), times tokens/s of the whole job, over the job's peak for the compute dtype
(bf16 figure for bf16/fp16, plain fp32 otherwise). Activation recomputation is not counted (that would be HFU).

The peak is, in this order: the hardware catalog's datasheet figure for a GPU it knows (× world size); else a peak
measured on this host by a short dense matmul probe in the compute dtype, run once and cached per host (a CPU host's
figure is measured with all its cores, since its ranks share them, × the number of hosts). With neither (the probe
failed), there is no MFU: progress and report show "MFU —" and say why.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from scaletrain.config.folders import user_cache_dir
from scaletrain.config.precisions import precision
from scaletrain.hardware.catalog import GPUS
from scaletrain.hardware.detect import catalog_name_for

NO_PEAK_HINT = "the start-up matmul probe measures one and caches it per host; it failed here, so the next run retries"


def peak_cache_file() -> Path:
    """Where measured peaks are kept: $XDG_CACHE_HOME/scaletrain/peak_flops.json (default ~/.cache)."""
    return user_cache_dir() / "peak_flops.json"


def _probe_key(device: torch.device, dtype: torch.dtype) -> str:
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{os.cpu_count()}"
    return f"{platform.node()}|{what}|{dtype}|torch {torch.__version__}"


def probe_matmul_flops(device: torch.device, dtype: torch.dtype, seconds: float = 0.3) -> float:
    """Best FLOP/s of a square dense matmul (2·n³ FLOPs) on `device` over about `seconds`; on a CPU with all cores."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)  # the host's peak: its ranks share every core
    try:
        best, deadline = 0.0, time.perf_counter() + seconds
        torch.mm(a, b)  # warm-up: thread pool, kernels
        while True:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            torch.mm(a, b)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = max(best, 2 * n**3 / (time.perf_counter() - t0))
            if time.perf_counter() > deadline:
                return best
    finally:
        torch.set_num_threads(threads)


def measured_peak(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(FLOP/s of one device, or of this whole CPU host; where it came from), from the per-host cache or a probe
    now (cached). RuntimeError when the probe cannot run."""
    path, key = peak_cache_file(), _probe_key(device, dtype)
    try:
        cache = json.loads(path.read_text())
        if not isinstance(cache, dict):
            cache = {}
    except (OSError, ValueError):
        cache = {}
    hit = cache.get(key)
    if isinstance(hit, dict) and isinstance(hit.get("flops"), (int, float)) and hit["flops"] > 0:
        flops, when = float(hit["flops"]), hit.get("measured", "?")
    else:
        flops, when = probe_matmul_flops(device, dtype), time.strftime("%Y-%m-%d %H:%M")
        cache[key] = {"flops": flops, "measured": when}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(cache, indent=1) + "\n")
            tmp.replace(path)  # atomic: two jobs starting on one host never leave half a file
        except OSError as e:  # still measured; the next run probes again
            when += f", not cached: {e.strerror}"
    where = "this host, all cores" if device.type == "cpu" else "this device"
    return flops, f"measured on {where} ({str(dtype).removeprefix('torch.')} matmul probe, {when}; cache {path})"


def peak_flops(device: torch.device, dtype: str, world_size: int) -> tuple[float | None, str]:
    """(peak FLOP/s of the whole job, where the figure comes from); None, with the reason, when no peak is known."""
    figure = precision(dtype).datasheet_rate
    if device.type == "cuda":
        name = catalog_name_for(torch.cuda.get_device_name(device))
        if name is not None and name in GPUS:
            spec = GPUS[name]
            flops = spec.bf16_flops if figure == "bf16" else spec.fp32_flops
            source = spec.sources.get(figure, "catalog")
            return flops * world_size, f"{world_size} x {name} {figure} {flops / 1e12:g} TFLOP/s (datasheet: {source})"
        count = world_size
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)
        count = max(world_size // max(local, 1), 1)  # hosts: CPU ranks on one host share its cores
    try:
        flops, source = measured_peak(device, torch.bfloat16 if figure == "bf16" else torch.float32)
    except RuntimeError as e:  # e.g. out of memory, or a device that cannot multiply in this dtype
        return None, f"no known peak FLOP/s ({e}); {NO_PEAK_HINT}"
    return flops * count, f"{count} x {flops / 1e12:.3g} TFLOP/s {source}"
