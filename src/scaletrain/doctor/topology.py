"""GPU-to-GPU paths: parsing `nvidia-smi topo -m`, and what a PCIe link carries.

The matrix codes, from nvidia-smi's own legend: X self; NV# a bonded set of # NVLinks; PIX at most one PCIe
bridge; PXB several PCIe bridges, no host bridge; PHB a PCIe host bridge (the CPU); NODE host bridges within one
NUMA node; SYS across NUMA nodes (the CPUs' socket interconnect, e.g. UPI).
"""

from __future__ import annotations

import re

# Per-lane PCIe bandwidth per direction, bytes/s: raw transfer rate x line-code efficiency / 8 bits
# (PCI-SIG base specifications: gen1-2 8b/10b, gen3-5 128b/130b; gen6 PAM4 with FLIT, ~242/256 usable).
PCIE_LANE_BW = {
    1: 2.5e9 * 0.8 / 8,
    2: 5e9 * 0.8 / 8,
    3: 8e9 * 128 / 130 / 8,
    4: 16e9 * 128 / 130 / 8,
    5: 32e9 * 128 / 130 / 8,
    6: 64e9 * 242 / 256 / 8,
}

PATH_VERDICT = {
    "PIX": ("pass", "PCIe through one switch"),
    "PXB": ("pass", "PCIe through several switches, no host bridge"),
    "PHB": ("warn", "PCIe through the CPU's host bridge: peer-to-peer is slower"),
    "NODE": ("warn", "PCIe across host bridges of one NUMA node"),
    "SYS": ("warn", "PCIe across CPU sockets (UPI/QPI): the slowest GPU path"),
}


def pcie_bandwidth(gen: int, width: int) -> float | None:
    """One direction of a PCIe link, bytes/s; None for an unknown generation."""
    lane = PCIE_LANE_BW.get(gen)
    return lane * width if lane else None


def parse_topo_matrix(text: str) -> dict[tuple[str, str], str]:
    """{("GPU0", "GPU1"): "NV18", ...} for every GPU pair (i < j) in `nvidia-smi topo -m` output."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", ln) for ln in text.splitlines()]
    header = next(
        (
            ln.split()
            for ln in lines
            if ln.split()[:1] == ["GPU0"] or (ln.startswith((" ", "\t")) and "GPU0" in ln.split())
        ),
        None,
    )
    if header is None:
        return {}
    gpus = [h for h in header if re.fullmatch(r"GPU\d+", h)]
    pairs: dict[tuple[str, str], str] = {}
    for ln in lines:
        cells = ln.split()
        if not cells or not re.fullmatch(r"GPU\d+", cells[0]) or len(cells) < len(gpus) + 1:
            continue
        row = cells[0]
        for col, code in zip(gpus, cells[1 : 1 + len(gpus)]):
            if int(row[3:]) < int(col[3:]):
                pairs[(row, col)] = code
    return pairs


def path_verdict(code: str) -> tuple[str, str]:
    """(status, reason) for one matrix code."""
    m = re.fullmatch(r"NV(\d+)", code)
    if m:
        return "pass", f"NVLink x{m.group(1)}"
    return PATH_VERDICT.get(code, ("warn", f"unknown path code {code!r}"))
