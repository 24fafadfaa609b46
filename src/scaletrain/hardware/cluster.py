"""A cluster: GPU type, GPUs per node, nodes, the links inside and between nodes, price and power figures.

Built from command-line flags or read from a TOML cluster file (unknown keys rejected), which may also define
GPUs and links the catalog lacks:

    gpu = "h100-sxm"            # catalog name, or one defined under [gpu_types.NAME]
    gpus_per_node = 8
    nodes = 8
    intra_node_link = "nvlink4"
    inter_node_link = "ib-ndr"
    nics_per_node = 8           # inter-node ports per node (default: one per GPU)
    usd_per_gpu_hour = 2.2
    pue = 1.25

    [gpu_types.my-gpu]
    memory_gb = 96
    memory_bw_tbs = 4.0
    bf16_tflops = 800
    power_w = 600
    source = "vendor datasheet, 2025"
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from scaletrain.config.load import validation_error_line
from scaletrain.hardware.catalog import GB, TB, TFLOPS, GPUSpec, LinkSpec, get_gpu, get_link
from scaletrain.config.toml_file import read_toml

# Data-centre overheads: placeholders, not datasheet figures (formulas.md has none); a cluster file overrides them.
DEFAULT_PUE = 1.3  # unconfirmed: a typical modern data-centre PUE
# unconfirmed: CPUs, memory, NICs and fans of a node as a share of its GPUs' power; a DGX H100 lists ~10.2 kW max
# for 8 x 700 W GPUs, i.e. ~0.8 of the GPU power on top
DEFAULT_NODE_OVERHEAD_FRACTION = 0.8


class ClusterFileError(ValueError):
    """A cluster file a user wrote is wrong; the message is one line naming the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class GPUTypeEntry(_Strict):
    memory_gb: float = Field(gt=0, description="device memory, GB (1e9 bytes)")
    memory_bw_tbs: float = Field(gt=0, description="memory bandwidth, TB/s")
    bf16_tflops: float = Field(gt=0, description="dense bf16 TFLOP/s")
    fp32_tflops: float | None = Field(None, gt=0, description="dense fp32 TFLOP/s (default bf16 / 16)")
    power_w: float = Field(gt=0, description="board power, watts")
    matmul_efficiency: float = Field(0.8, gt=0, le=1)
    intra_node_link: str = "pcie5"
    inter_node_link: str = "ib-ndr"
    usd_per_gpu_hour: float = Field(0.0, ge=0)
    source: str = Field(min_length=1, description="where the figures come from")


class LinkEntry(_Strict):
    bandwidth_gbs: float = Field(gt=0, description="GB/s per GPU (or per NIC port) per direction")
    kind: Literal["intra", "inter"]
    efficiency: float = Field(0.8, gt=0, le=1)
    latency_us: float = Field(5.0, ge=0)
    source: str = Field(min_length=1)


class ClusterFile(_Strict):
    name: str = "cluster"
    gpu: str
    gpus_per_node: int = Field(gt=0)
    nodes: int = Field(1, gt=0)
    intra_node_link: str | None = None
    inter_node_link: str | None = None
    nics_per_node: int | None = Field(None, gt=0)
    usd_per_gpu_hour: float | None = Field(None, ge=0)
    pue: float = Field(DEFAULT_PUE, ge=1.0)
    node_overhead_w: float | None = Field(None, ge=0, description="non-GPU power per node, watts")
    gpu_types: dict[str, GPUTypeEntry] = Field(default_factory=dict)
    links: dict[str, LinkEntry] = Field(default_factory=dict)


@dataclass(frozen=True)
class Cluster:
    """What the planner runs against. Bandwidths in bytes/s, power in watts, prices in USD."""

    name: str
    gpu: GPUSpec
    gpus: int
    gpus_per_node: int
    intra_link: LinkSpec
    inter_link: LinkSpec
    nics_per_node: float
    usd_per_gpu_hour: float
    pue: float
    node_overhead_w: float
    # measured on the host by `scaletrain bench` (None: datasheet figures)
    measured_matmul_flops: float | None = None
    measured_busbw: float | None = None
    measured_memory_bw: float | None = None
    measured_memory_bytes: float | None = None
    measured_op_overhead_s: float | None = None
    # measured curves (hardware/calibration.py): (GEMM intensity, FLOP/s), (bytes a kernel moves, bytes/s), and
    # (collective kind, latency per ring step in s, bus bandwidth in bytes/s) between the host's local ranks
    measured_matmul_curve: tuple[tuple[float, float], ...] | None = None
    measured_copy_curve: tuple[tuple[float, float], ...] | None = None
    measured_collectives: tuple[tuple[str, float, float], ...] | None = None
    # CPU hosts (`scaletrain bench` on a CPU, plan/steptime.py): GEMM rate by shape (m, n, k, FLOP/s), the cores the
    # ranks share, and a collective's extra wait amid compute, (compute gap s, seconds)
    measured_matmul_shapes: tuple[tuple[float, float, float, float], ...] | None = None
    host_cores: int | None = None
    measured_sync_curve: tuple[tuple[float, float], ...] | None = None
    # the same wait for a group spanning nodes, measured over every rank of every node (`scaletrain bench --nodes`)
    measured_inter_sync_curve: tuple[tuple[float, float], ...] | None = None
    calibration_note: str = ""
    # (collective kind, latency per ring step in s, bus bandwidth in bytes/s) of one ring over every rank of
    # several nodes, measured by `scaletrain bench --nodes` (plan/comm.py prices groups that span nodes with it)
    measured_inter_collectives: tuple[tuple[str, float, float], ...] | None = None
    # causal attention forward + backward, (sequence length, head dim, FLOP/s) measured by `scaletrain bench`
    measured_attention: tuple[tuple[float, float, float], ...] | None = None
    # CPU: a real step measured op by op by bench: its GEMMs (m, n, k, FLOP/s), its attention (seq, head dim,
    # FLOP/s) and the bytes/s of its memory-bound ops (plan/efficiency.py scales the curves to them)
    measured_step_matmul: tuple[tuple[float, float, float, float], ...] | None = None
    measured_step_attention: tuple[tuple[float, float, float], ...] | None = None
    measured_step_pointwise_bw: float | None = None

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    @property
    def memory_bytes(self) -> float:
        """Device memory per GPU, bytes."""
        return self.measured_memory_bytes or self.gpu.memory_bytes

    @property
    def memory_bw(self) -> float:
        return self.measured_memory_bw or self.gpu.memory_bw

    @property
    def op_overhead_s(self) -> float:
        """Host seconds to dispatch one eager op (GPUSpec.op_overhead_s unless measured)."""
        return self.measured_op_overhead_s or self.gpu.op_overhead_s

    @property
    def intra_bw(self) -> float:
        """Achievable per-GPU bandwidth inside a node (ring bus bandwidth), bytes/s."""
        return self.measured_busbw or self.intra_link.bandwidth * self.intra_link.efficiency

    def intra_collective(self, kind: str) -> tuple[float, float]:
        """(latency per ring step in s, bus bandwidth in bytes/s) of a collective inside a node: measured by
        `scaletrain bench` for this kind (a reduce-scatter it did not measure: as an all-gather, which moves as
        much), else the link's."""
        measured = {k: (lat, bw) for k, lat, bw in self.measured_collectives or ()}
        key = "all_gather" if kind == "reduce_scatter" and kind not in measured else kind
        return measured.get(key, (self.intra_link.latency_s, self.intra_bw))

    def inter_collective(self, kind: str) -> tuple[float, float] | None:
        """(latency per ring step in s, bus bandwidth in bytes/s) of a ring spanning nodes, measured by
        `scaletrain bench --nodes` for this kind (an unmeasured reduce-scatter as an all-gather); None if not."""
        measured = {k: (lat, bw) for k, lat, bw in self.measured_inter_collectives or ()}
        return measured.get("all_gather" if kind == "reduce_scatter" and kind not in measured else kind)

    @property
    def inter_bw_per_gpu(self) -> float:
        """Achievable inter-node bandwidth one GPU's share of the node's NICs gives, bytes/s (measured: the
        node's link, which one cross-node ring stream gets, shared by every rank of the node)."""
        measured = self.inter_collective("all_reduce")
        if measured is not None:
            return measured[1] / self.gpus_per_node
        return self.inter_link.bandwidth * self.inter_link.efficiency * self.nics_per_node / self.gpus_per_node

    @property
    def node_power_w(self) -> float:
        """Power of one full node at load, watts (GPUs + node overhead), before PUE."""
        return self.gpus_per_node * self.gpu.power_w + self.node_overhead_w

    def with_gpus(self, gpus: int) -> Cluster:
        """The same kind of cluster with `gpus` GPUs: fewer than a node shrinks the node, else whole nodes."""
        if gpus < self.gpus_per_node:
            return dataclasses.replace(
                self, gpus=gpus, gpus_per_node=gpus, node_overhead_w=self.node_overhead_w * gpus / self.gpus_per_node
            )
        return dataclasses.replace(self, gpus=gpus)


@dataclass(frozen=True)
class ClusterFields:
    """What the user called make_cluster's inputs, for its one-line errors: `scaletrain plan`'s flags (FLAGS), a
    cluster file's keys (FILE_KEYS), or --compare-gpus for the GPU types compared."""

    gpu: str = "--gpu"
    interconnect: str = "--interconnect"
    gpus: str = "--gpus"
    gpus_per_node: str = "--gpus-per-node"


FLAGS = ClusterFields()
FILE_KEYS = ClusterFields("gpu", "intra_node_link/inter_node_link", "nodes/gpus_per_node", "gpus_per_node")


def make_cluster(
    gpu: str,
    gpus: int,
    interconnect: str | None = None,
    gpus_per_node: int | None = None,
    usd_per_gpu_hour: float | None = None,
    pue: float = DEFAULT_PUE,
    nics_per_node: int | None = None,
    node_overhead_w: float | None = None,
    extra_gpus: dict[str, GPUSpec] | None = None,
    extra_links: dict[str, LinkSpec] | None = None,
    name: str = "cluster",
    fields: ClusterFields = FLAGS,
) -> Cluster:
    """A cluster of `gpus` GPUs of type `gpu`; interconnect is "INTRA[,INTER]" link names. ValueError (one line
    naming the input as `fields` calls it) on bad input."""
    spec = get_gpu(gpu, extra_gpus, fields.gpu)
    if gpus < 1:
        raise ValueError(f"{fields.gpus}: must be at least 1 (got {gpus})")
    intra_name, inter_name = spec.default_intra_link, spec.default_inter_link
    if interconnect:
        parts = [p.strip() for p in interconnect.split(",") if p.strip()]
        if not parts or len(parts) > 2:
            raise ValueError(
                f"{fields.interconnect}: expected INTRA[,INTER] such as nvlink4,ib-ndr (got {interconnect!r})"
            )
        intra_name = parts[0]
        inter_name = parts[1] if len(parts) > 1 else inter_name
    intra = get_link(intra_name, extra_links, fields.interconnect)
    inter = get_link(inter_name, extra_links, fields.interconnect)
    if intra.kind != "intra":
        raise ValueError(
            f"{fields.interconnect}: {intra.name} links nodes, not GPUs inside a node; put it second "
            f"(e.g. nvlink4,{intra.name})"
        )
    if inter.kind != "inter":
        raise ValueError(
            f"{fields.interconnect}: {inter.name} is a link inside a node; the second link must join nodes "
            f"(e.g. ib-ndr, roce-400)"
        )
    gpn = gpus_per_node or spec.default_gpus_per_node
    if gpus < gpn:
        gpn = gpus
    elif gpus % gpn:
        raise ValueError(
            f"{fields.gpus}: {gpus} GPUs are not a whole number of {gpn}-GPU nodes; use a multiple of {gpn} "
            f"or set {fields.gpus_per_node}"
        )
    nics = nics_per_node if nics_per_node is not None else gpn
    overhead = node_overhead_w if node_overhead_w is not None else DEFAULT_NODE_OVERHEAD_FRACTION * gpn * spec.power_w
    price = usd_per_gpu_hour if usd_per_gpu_hour is not None else spec.usd_per_gpu_hour
    return Cluster(name, spec, gpus, gpn, intra, inter, nics, price, pue, overhead)


def _custom_gpu(name: str, e: GPUTypeEntry) -> GPUSpec:
    src = f"cluster file: {e.source}"
    return GPUSpec(
        name,
        name,
        e.memory_gb * GB,
        e.memory_bw_tbs * TB,
        e.bf16_tflops * TFLOPS,
        (e.fp32_tflops or e.bf16_tflops / 16) * TFLOPS,
        None,
        e.power_w,
        e.matmul_efficiency,
        0.5,
        e.intra_node_link,
        e.inter_node_link,
        8,
        e.usd_per_gpu_hour,
        {k: src for k in ("memory", "memory_bw", "bf16", "power", "matmul_efficiency", "price")},
    )


def _custom_link(name: str, e: LinkEntry) -> LinkSpec:
    src = f"cluster file: {e.source}"
    return LinkSpec(
        name,
        name,
        e.bandwidth_gbs * GB,
        e.efficiency,
        e.latency_us * 1e-6,
        e.kind,
        {"bandwidth": src, "efficiency": src, "latency": src},
    )


def load_cluster(path: str | Path, gpus: int | None = None) -> Cluster:
    """Read a TOML cluster file; `gpus` (default: all of it) takes part of it. ClusterFileError: one line."""
    p = Path(path)
    where = f"cluster file {str(p)!r}"
    tree = read_toml(p, "cluster file", ClusterFileError)
    try:
        f = ClusterFile.model_validate(tree)
    except ValidationError as e:
        raise ClusterFileError(f"{where}: {validation_error_line(e, ClusterFile, 'file')}") from None
    gpus_defined = {n.lower(): _custom_gpu(n.lower(), e) for n, e in f.gpu_types.items()}
    links_defined = {n.lower(): _custom_link(n.lower(), e) for n, e in f.links.items()}
    total = f.gpus_per_node * f.nodes
    if gpus is not None and gpus > total:
        raise ClusterFileError(
            f"{where}: --gpus {gpus} is more than the file's {f.nodes} nodes x {f.gpus_per_node} GPUs = {total}"
        )
    interconnect = None
    if f.intra_node_link or f.inter_node_link:
        try:
            spec = get_gpu(f.gpu, gpus_defined, FILE_KEYS.gpu)
        except ValueError as e:
            raise ClusterFileError(f"{where}: {e}") from None
        interconnect = f"{f.intra_node_link or spec.default_intra_link},{f.inter_node_link or spec.default_inter_link}"
    try:
        return make_cluster(
            f.gpu,
            gpus or total,
            interconnect,
            f.gpus_per_node,
            f.usd_per_gpu_hour,
            f.pue,
            f.nics_per_node,
            f.node_overhead_w,
            gpus_defined,
            links_defined,
            f.name,
            FILE_KEYS,
        )
    except ValueError as e:
        raise ClusterFileError(f"{where}: {e}") from None
