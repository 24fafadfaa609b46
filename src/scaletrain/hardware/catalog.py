"""Datasheet figures of accelerators and links, each with its source.

Units are decimal SI: bytes, bytes/s, FLOP/s, watts. Sources are tagged as in shared/notes/formulas.md:
[R] read in the primary source, [T] from third-party transcriptions that agree, "unconfirmed" where no source was
seen: those are placeholders a user should replace (a cluster file, or `scaletrain bench` calibration).
"""

from __future__ import annotations

from dataclasses import dataclass, field

GB = 1e9
TB = 1e12
TFLOPS = 1e12
GBIT = 1e9 / 8  # bytes/s in one Gb/s

ML_ENG = "stas00/ml-engineering compute/accelerator README [T]"
ML_ENG_NET = "stas00/ml-engineering network README [T]"
UNCONFIRMED = "unconfirmed"


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator as the planner sees it."""

    name: str
    description: str
    memory_bytes: float
    memory_bw: float  # bytes/s
    bf16_flops: float  # dense FLOP/s
    fp32_flops: float  # dense FLOP/s of plain fp32 (no TF32), what precision.dtype=fp32 runs at
    fp8_flops: float | None
    power_w: float  # board power at full load, watts
    matmul_efficiency: float  # measured share of bf16 peak a large matmul reaches
    attention_efficiency: float  # share of bf16 peak a fused attention kernel reaches, forward + backward
    default_intra_link: str
    default_inter_link: str
    default_gpus_per_node: int
    usd_per_gpu_hour: float  # placeholder price for cost estimates; set your own in a cluster file
    sources: dict[str, str] = field(default_factory=dict)  # figure -> source
    # share of overlappable communication (FSDP gathers, gradient reductions) that hides behind compute: NCCL
    # runs on its own SMs and copy engines; gloo on a CPU host runs on the cores the compute ops need
    comm_overlap: float = 1.0
    # host time to dispatch one eager PyTorch op (Python, dispatcher, kernel launch), seconds; a GPU hides it behind
    # kernels that run longer, a CPU pays it in line. unconfirmed typical figure; `scaletrain bench` measures it
    op_overhead_s: float = 6e-6

    def is_unconfirmed(self, figure: str) -> bool:
        return UNCONFIRMED in self.sources.get(figure, UNCONFIRMED)


@dataclass(frozen=True)
class LinkSpec:
    """A link one GPU uses to talk to its peers: per-GPU bandwidth in one direction, bytes/s."""

    name: str
    description: str
    bandwidth: float  # bytes/s per GPU per direction (inter-node: per NIC port)
    efficiency: float  # measured all-reduce bus bandwidth / link bandwidth
    latency_s: float  # per ring step, seconds
    kind: str  # "intra" (inside a node) or "inter" (between nodes)
    sources: dict[str, str] = field(default_factory=dict)


_PRICE_SRC = f"{UNCONFIRMED}: placeholder list price, set usd_per_gpu_hour in a cluster file"
_FP32_SRC = f"{UNCONFIRMED}: vendor datasheet non-tensor FP32, not in formulas.md"
_ATTN_SRC = (
    f"{UNCONFIRMED}: FlashAttention-2 paper reports 50-73% of peak on A100; FlashAttention-3 paper ~35% for FA2 on H100"
)

GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        GPUSpec(
            "h100-sxm",
            "NVIDIA H100 SXM 80 GB",
            80 * GB,
            3.35 * TB,
            989 * TFLOPS,
            67 * TFLOPS,
            1979 * TFLOPS,
            700,
            0.80,
            0.35,
            "nvlink4",
            "ib-ndr",
            8,
            3.00,
            {
                "memory": ML_ENG,
                "memory_bw": ML_ENG,
                "bf16": ML_ENG,
                "fp8": ML_ENG,
                "power": ML_ENG,
                "matmul_efficiency": "formulas.md: measured bf16 matmul ceiling H100 SXM ~80 % [T]",
                "fp32": _FP32_SRC,
                "attention_efficiency": _ATTN_SRC,
                "price": _PRICE_SRC,
            },
        ),
        GPUSpec(
            "h100-pcie",
            "NVIDIA H100 PCIe 80 GB",
            80 * GB,
            2.0 * TB,
            756 * TFLOPS,
            51 * TFLOPS,
            1513 * TFLOPS,
            350,
            0.80,
            0.35,
            "pcie5",
            "ib-ndr",
            8,
            2.50,
            {
                "memory": ML_ENG,
                "memory_bw": ML_ENG,
                "bf16": ML_ENG,
                "fp8": ML_ENG,
                "power": ML_ENG,
                "matmul_efficiency": f"{UNCONFIRMED}: H100 SXM's ~80 % assumed",
                "fp32": _FP32_SRC,
                "attention_efficiency": _ATTN_SRC,
                "price": _PRICE_SRC,
            },
        ),
        GPUSpec(
            "h200",
            "NVIDIA H200 SXM 141 GB",
            141 * GB,
            4.8 * TB,
            989 * TFLOPS,
            67 * TFLOPS,
            1979 * TFLOPS,
            700,
            0.80,
            0.35,
            "nvlink4",
            "ib-ndr",
            8,
            3.50,
            {
                "memory": ML_ENG,
                "memory_bw": ML_ENG,
                "bf16": ML_ENG,
                "fp8": ML_ENG,
                "power": ML_ENG,
                "matmul_efficiency": f"{UNCONFIRMED}: H100 SXM's ~80 % assumed (same compute die)",
                "fp32": _FP32_SRC,
                "attention_efficiency": _ATTN_SRC,
                "price": _PRICE_SRC,
            },
        ),
        GPUSpec(
            "a100-80gb",
            "NVIDIA A100 SXM 80 GB",
            80 * GB,
            2.0 * TB,
            312 * TFLOPS,
            19.5 * TFLOPS,
            None,
            400,
            0.87,
            0.50,
            "nvlink3",
            "ib-hdr",
            8,
            1.80,
            {
                "memory": ML_ENG,
                "memory_bw": ML_ENG,
                "bf16": ML_ENG,
                "power": ML_ENG,
                "matmul_efficiency": "formulas.md: measured bf16 matmul ceiling A100 ~87 % [T]",
                "fp32": _FP32_SRC,
                "attention_efficiency": _ATTN_SRC,
                "price": _PRICE_SRC,
            },
        ),
        GPUSpec(
            "a100-40gb",
            "NVIDIA A100 40 GB",
            40 * GB,
            1.56 * TB,
            312 * TFLOPS,
            19.5 * TFLOPS,
            None,
            400,
            0.87,
            0.50,
            "nvlink3",
            "ib-hdr",
            8,
            1.30,
            {
                "memory": ML_ENG,
                "memory_bw": f"{UNCONFIRMED} (formulas.md)",
                "bf16": ML_ENG,
                "power": f"{UNCONFIRMED} (formulas.md): 400 W SXM / 250 W PCIe; SXM used",
                "matmul_efficiency": "formulas.md: measured bf16 matmul ceiling A100 ~87 % [T]",
                "fp32": _FP32_SRC,
                "attention_efficiency": _ATTN_SRC,
                "price": _PRICE_SRC,
            },
        ),
        GPUSpec(
            "l40s",
            "NVIDIA L40S 48 GB",
            48 * GB,
            0.86 * TB,
            362 * TFLOPS,
            91.6 * TFLOPS,
            733 * TFLOPS,
            350,
            0.80,
            0.50,
            "pcie4",
            "roce-200",
            8,
            1.00,
            {
                "memory": ML_ENG,
                "memory_bw": ML_ENG,
                "bf16": ML_ENG,
                "fp8": ML_ENG,
                "power": ML_ENG,
                "intra_link": f"{UNCONFIRMED} (formulas.md): no NVLink; PCIe4",
                "matmul_efficiency": f"{UNCONFIRMED}: H100 SXM's ~80 % assumed",
                "fp32": _FP32_SRC,
                "attention_efficiency": _ATTN_SRC,
                "price": _PRICE_SRC,
            },
        ),
        GPUSpec(
            "b200",
            "NVIDIA B200 180 GB",
            180 * GB,
            8.0 * TB,
            2250 * TFLOPS,
            80 * TFLOPS,
            4500 * TFLOPS,
            1000,
            0.78,
            0.35,
            "nvlink5",
            "ib-xdr",
            8,
            5.00,
            {
                "memory": ML_ENG,
                "memory_bw": ML_ENG,
                "bf16": ML_ENG,
                "fp8": ML_ENG,
                "power": f"{ML_ENG}: 1,000 W max",
                "matmul_efficiency": "formulas.md: measured bf16 matmul ceiling B200 ~78 % [T]",
                "fp32": _FP32_SRC,
                "attention_efficiency": _ATTN_SRC,
                "price": _PRICE_SRC,
            },
        ),
        GPUSpec(
            "rtx-4090",
            "NVIDIA GeForce RTX 4090 24 GB",
            24 * GB,
            1.0 * TB,
            165 * TFLOPS,
            82.6 * TFLOPS,
            330 * TFLOPS,
            450,
            0.80,
            0.50,
            "pcie4",
            "roce-100",
            8,
            0.40,
            {
                "memory": ML_ENG,
                "memory_bw": f"{UNCONFIRMED} (formulas.md)",
                "bf16": f"{UNCONFIRMED} (formulas.md)",
                "fp8": f"{UNCONFIRMED} (formulas.md)",
                "power": f"{UNCONFIRMED} (formulas.md)",
                "matmul_efficiency": f"{UNCONFIRMED}: H100 SXM's ~80 % assumed",
                "fp32": _FP32_SRC,
                "attention_efficiency": _ATTN_SRC,
                "price": _PRICE_SRC,
            },
        ),
        # A CPU socket running gloo ranks: every figure is a placeholder; `scaletrain bench` measures the real ones.
        GPUSpec(
            "cpu",
            "CPU host (gloo ranks)",
            64 * GB,
            0.1 * TB,
            1 * TFLOPS,
            1 * TFLOPS,
            None,
            250,
            1.0,
            1.0,
            "loopback",
            "ethernet-10",
            1,
            0.05,
            {
                k: f"{UNCONFIRMED}: placeholder; run `scaletrain bench` and pass --calibration"
                for k in (
                    "memory",
                    "memory_bw",
                    "bf16",
                    "fp32",
                    "power",
                    "matmul_efficiency",
                    "attention_efficiency",
                    "price",
                )
            }
            | {
                "comm_overlap": "gloo's collectives run on CPU threads that compete with compute for the same cores, "
                "so none hides behind it (benchmarks/layouts.py: ddp4 beats fsdp4 on 4 CPU ranks)"
            },
            comm_overlap=0.0,
            op_overhead_s=4e-6,
        ),
    )
}

_NVL_EFF = "formulas.md: measured all-reduce busbw 8xA100 NVLink3 ~235 of 300 GB/s [T]"
_NVL4_EFF = "formulas.md: measured all-reduce busbw 8xH200 ring ~368 of 450 GB/s [T]"
_EFF_PLACEHOLDER = f"{UNCONFIRMED}: 0.8 of link speed assumed"
_LAT_PLACEHOLDER = f"{UNCONFIRMED}: placeholder per-step latency"

LINKS: dict[str, LinkSpec] = {
    link.name: link
    for link in (
        LinkSpec(
            "pcie3",
            "PCIe 3.0 x16",
            15.75 * GB,
            0.8,
            5e-6,
            "intra",
            {
                "bandwidth": f"{UNCONFIRMED}: half of PCIe4 x16",
                "efficiency": _EFF_PLACEHOLDER,
                "latency": _LAT_PLACEHOLDER,
            },
        ),
        LinkSpec(
            "pcie4",
            "PCIe 4.0 x16",
            31 * GB,
            0.8,
            5e-6,
            "intra",
            {
                "bandwidth": "formulas.md: PCIe4 x16 ~31 GB/s per direction [T]",
                "efficiency": _EFF_PLACEHOLDER,
                "latency": _LAT_PLACEHOLDER,
            },
        ),
        LinkSpec(
            "pcie5",
            "PCIe 5.0 x16",
            63 * GB,
            0.8,
            5e-6,
            "intra",
            {
                "bandwidth": "formulas.md: PCIe5 x16 ~63 GB/s per direction [T]",
                "efficiency": _EFF_PLACEHOLDER,
                "latency": _LAT_PLACEHOLDER,
            },
        ),
        LinkSpec(
            "pcie6",
            "PCIe 6.0 x16",
            126 * GB,
            0.8,
            5e-6,
            "intra",
            {
                "bandwidth": f"{UNCONFIRMED}: twice PCIe5 x16",
                "efficiency": _EFF_PLACEHOLDER,
                "latency": _LAT_PLACEHOLDER,
            },
        ),
        LinkSpec(
            "nvlink3",
            "NVLink 3 (A100)",
            300 * GB,
            235 / 300,
            3e-6,
            "intra",
            {
                "bandwidth": "formulas.md: NVLink3 300 GB/s per direction [T]",
                "efficiency": _NVL_EFF,
                "latency": _LAT_PLACEHOLDER,
            },
        ),
        LinkSpec(
            "nvlink4",
            "NVLink 4 (H100/H200)",
            450 * GB,
            368 / 450,
            3e-6,
            "intra",
            {
                "bandwidth": "formulas.md: NVLink4 450 GB/s per direction [T]",
                "efficiency": _NVL4_EFF,
                "latency": _LAT_PLACEHOLDER,
            },
        ),
        LinkSpec(
            "nvlink5",
            "NVLink 5 (B200)",
            900 * GB,
            368 / 450,
            3e-6,
            "intra",
            {
                "bandwidth": "formulas.md: NVLink5 900 GB/s per direction [T]",
                "efficiency": f"{UNCONFIRMED}: NVLink4's measured share assumed",
                "latency": _LAT_PLACEHOLDER,
            },
        ),
        LinkSpec(
            "loopback",
            "one host's shared memory (gloo)",
            5 * GB,
            1.0,
            20e-6,
            "intra",
            {
                "bandwidth": f"{UNCONFIRMED}: placeholder; run `scaletrain bench`",
                "efficiency": f"{UNCONFIRMED}: placeholder",
                "latency": _LAT_PLACEHOLDER,
            },
        ),
        LinkSpec(
            "ib-hdr",
            "InfiniBand HDR 200 Gb/s per port",
            200 * GBIT,
            0.8,
            5e-6,
            "inter",
            {
                "bandwidth": "formulas.md: InfiniBand 4x HDR 200 Gb/s [T]",
                "efficiency": _EFF_PLACEHOLDER,
                "latency": _LAT_PLACEHOLDER,
            },
        ),
        LinkSpec(
            "ib-ndr",
            "InfiniBand NDR 400 Gb/s per port",
            400 * GBIT,
            0.8,
            5e-6,
            "inter",
            {
                "bandwidth": "formulas.md: InfiniBand 4x NDR 400 Gb/s [T]",
                "efficiency": _EFF_PLACEHOLDER,
                "latency": _LAT_PLACEHOLDER,
            },
        ),
        LinkSpec(
            "ib-xdr",
            "InfiniBand XDR 800 Gb/s per port",
            800 * GBIT,
            0.8,
            5e-6,
            "inter",
            {
                "bandwidth": "formulas.md: InfiniBand 4x XDR 800 Gb/s [T]",
                "efficiency": _EFF_PLACEHOLDER,
                "latency": _LAT_PLACEHOLDER,
            },
        ),
        LinkSpec(
            "roce-100",
            "RoCE 100 GbE per port",
            100 * GBIT,
            0.8,
            8e-6,
            "inter",
            {"bandwidth": "formulas.md: RoCE 100 GbE [T]", "efficiency": _EFF_PLACEHOLDER, "latency": _LAT_PLACEHOLDER},
        ),
        LinkSpec(
            "roce-200",
            "RoCE 200 GbE per port",
            200 * GBIT,
            0.8,
            8e-6,
            "inter",
            {"bandwidth": "formulas.md: RoCE 200 GbE [T]", "efficiency": _EFF_PLACEHOLDER, "latency": _LAT_PLACEHOLDER},
        ),
        LinkSpec(
            "roce-400",
            "RoCE 400 GbE per port",
            400 * GBIT,
            0.8,
            8e-6,
            "inter",
            {"bandwidth": "formulas.md: RoCE 400 GbE [T]", "efficiency": _EFF_PLACEHOLDER, "latency": _LAT_PLACEHOLDER},
        ),
        LinkSpec(
            "ethernet-10",
            "10 GbE (TCP, no RDMA)",
            10 * GBIT,
            0.7,
            50e-6,
            "inter",
            {
                "bandwidth": "10 Gb/s line rate",
                "efficiency": f"{UNCONFIRMED}: TCP overhead assumed",
                "latency": _LAT_PLACEHOLDER,
            },
        ),
    )
}

# A DGX H100 node has 8 x 400 Gb/s NICs, one per GPU (formulas.md [T]); the planner assumes one NIC port per GPU
# unless a cluster file says otherwise.
DEFAULT_NICS_PER_GPU = 1.0


def get_gpu(name: str, extra: dict[str, GPUSpec] | None = None, field: str = "--gpu") -> GPUSpec:
    """The catalog entry (or a cluster file's custom one) named `name`; ValueError naming `field` (what the user
    called it) lists the choices."""
    table = {**GPUS, **(extra or {})}
    key = name.strip().lower()
    if key not in table:
        raise ValueError(f"{field}: unknown GPU {name!r}; choose one of {', '.join(table)}")
    return table[key]


def get_link(name: str, extra: dict[str, LinkSpec] | None = None, field: str = "--interconnect") -> LinkSpec:
    """The link named `name`; ValueError naming `field` lists the choices."""
    table = {**LINKS, **(extra or {})}
    key = name.strip().lower()
    if key not in table:
        raise ValueError(f"{field}: unknown link {name!r}; choose from {', '.join(table)}")
    return table[key]
