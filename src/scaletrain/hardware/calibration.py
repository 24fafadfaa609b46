"""Calibration files: figures `scaletrain bench` measured on a host, used by the planner instead of datasheets."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path

import tomli_w

from scaletrain.hardware.cluster import Cluster


class CalibrationError(ValueError):
    """A calibration file is missing, malformed or from another device; one line."""


@dataclass(frozen=True)
class Calibration:
    device: str  # catalog name of what was measured ("cpu" on a CPU host)
    host: str
    ranks: int
    matmul_flops: float  # achieved FLOP/s of a large matmul in `matmul_dtype`
    matmul_dtype: str
    memory_bw: float  # bytes/s of a large copy (read + write)
    allreduce_busbw: float  # bytes/s, nccl-tests convention: algbw x 2(n-1)/n
    memory_bytes: float | None  # device memory (host RAM on a CPU host), bytes
    torch_version: str
    op_overhead_s: float | None = None  # host seconds per dispatched op of the built-in block (older files: none)

    def to_toml(self) -> str:
        body = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        return "# written by `scaletrain bench`; pass to `scaletrain plan --calibration`\n" + tomli_w.dumps(body)


def save_calibration(cal: Calibration, path: str | Path) -> None:
    Path(path).write_text(cal.to_toml())


def load_calibration(path: str | Path) -> Calibration:
    """Read a calibration TOML; CalibrationError names the problem."""
    p = Path(path)
    where = f"calibration file {str(p)!r}"
    if not p.is_file():
        raise CalibrationError(f"{where}: not found; write one with `scaletrain bench --output {p}`")
    try:
        tree = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise CalibrationError(f"{where}: not valid TOML: {e}") from None
    names = {f.name: f for f in dataclasses.fields(Calibration)}
    unknown = sorted(set(tree) - set(names))
    if unknown:
        raise CalibrationError(f"{where}: {unknown[0]}: unknown key; valid keys: {', '.join(names)}")
    missing = [n for n in names if n not in tree and n not in ("memory_bytes", "op_overhead_s")]
    if missing:
        raise CalibrationError(f"{where}: {missing[0]}: missing; rerun `scaletrain bench`")
    for key in ("matmul_flops", "memory_bw", "allreduce_busbw", "op_overhead_s"):
        if key in tree and (not isinstance(tree[key], (int, float)) or tree[key] <= 0):
            raise CalibrationError(f"{where}: {key}: must be a positive number (got {tree[key]!r})")
    return Calibration(**{k: tree.get(k) for k in names})  # type: ignore[arg-type]  # checked above


def apply_calibration(cluster: Cluster, cal: Calibration) -> Cluster:
    """The cluster with measured compute, memory and intra-node all-reduce figures in place of the datasheet's."""
    if cal.device != cluster.gpu.name:
        raise CalibrationError(
            f"--calibration: measured on {cal.device!r}, but the plan is for "
            f"{cluster.gpu.name!r}; use --gpu {cal.device} or drop --calibration"
        )
    return dataclasses.replace(
        cluster,
        measured_matmul_flops=cal.matmul_flops,
        measured_busbw=cal.allreduce_busbw,
        measured_memory_bw=cal.memory_bw,
        measured_memory_bytes=cal.memory_bytes,
        measured_op_overhead_s=cal.op_overhead_s,
        calibration_note=f"calibrated on {cal.host} ({cal.ranks} ranks, {cal.matmul_dtype} matmul)",
    )
