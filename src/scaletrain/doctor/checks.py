"""The host checks behind `scaletrain doctor`, one function each; every one returns Check rows and never raises.

Sources of truth: torch (CUDA devices, CUDA and NCCL versions), NVML through nvidia-ml-py (driver, processes on
each GPU, PCIe link, NVLink), `nvidia-smi topo -m` (the path between each GPU pair), /sys/class/infiniband
(InfiniBand and RoCE ports), statvfs of /dev/shm, getrlimit, and a measured all-reduce between local ranks.
Where a source is missing (a CPU host) the check is `skip` and says what it could not see.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from scaletrain.doctor.topology import parse_topo_matrix, path_verdict, pcie_bandwidth

GIB = 2**30
SHM_MIN_BYTES = 1 * GIB  # NCCL's shared-memory transport and DataLoader workers; Docker's default is 64 MiB
NOFILE_MIN = 4096  # each rank keeps sockets to its peers plus shared-memory handles of data workers
BW_WARN_SHARE = 0.5  # measured bus bandwidth under this share of the expected one: warn
BW_FAIL_SHARE = 0.1  # ... under this one: fail (a link misconfigured, or traffic on the wrong path)


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # pass | warn | fail | skip
    detail: str

    def as_dict(self) -> dict:
        return asdict(self)


def _nvml():
    """The initialised pynvml module, or the reason it is not usable."""
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return None, f"NVML unavailable ({e}): no NVIDIA driver on this host"
    return pynvml, ""


def check_gpus(nvml) -> list[Check]:
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        why = (
            f"torch {torch.__version__} is a CPU build"
            if torch.version.cuda is None
            else f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees none"
        )
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            why += f"; CUDA_VISIBLE_DEVICES={visible!r}"
        return [
            Check("gpus visible", "warn", f"no CUDA GPU visible ({why}): only CPU ranks over gloo can run here"),
            Check("gpus not shared", "skip", "not checked: no GPU"),
        ]
    names = {torch.cuda.get_device_name(i) for i in range(n)}
    rows = [
        Check(
            "gpus visible",
            "pass" if len(names) == 1 else "warn",
            f"{n} x {', '.join(sorted(names))}"
            + ("" if len(names) == 1 else ": mixed models, the slowest sets the pace"),
        )
    ]
    if nvml is None:
        rows.append(Check("gpus not shared", "skip", "not checked: NVML unavailable"))
        return rows
    me = os.getpid()
    busy = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        procs = []
        for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            try:
                procs += getattr(nvml, getter)(h)
            except Exception:
                pass
        others = [p for p in procs if p.pid != me]
        if others:
            used = sum((p.usedGpuMemory or 0) for p in others) / GIB
            busy.append(
                f"GPU{i}: {len(others)} other process(es) (pid {', '.join(str(p.pid) for p in others[:3])}"
                f", {used:.1f} GiB)"
            )
    rows.append(
        Check("gpus not shared", "warn" if busy else "pass", "; ".join(busy) if busy else "no other process on any GPU")
    )
    return rows


def check_versions(nvml) -> list[Check]:
    import torch

    rows = []
    if nvml is None:
        rows.append(Check("driver", "skip", "not checked: no NVIDIA driver (NVML could not load)"))
    else:
        drv = nvml.nvmlSystemGetDriverVersion()
        drv = drv.decode() if isinstance(drv, bytes) else drv
        cuda_max = nvml.nvmlSystemGetCudaDriverVersion()  # e.g. 12040 = the newest CUDA this driver runs
        max_str = f"{cuda_max // 1000}.{cuda_max % 1000 // 10}"
        status, detail = "pass", f"NVIDIA driver {drv}, runs CUDA up to {max_str}"
        if torch.version.cuda:
            want = tuple(int(x) for x in torch.version.cuda.split(".")[:2])
            if want > (cuda_max // 1000, cuda_max % 1000 // 10):
                status, detail = (
                    "fail",
                    (
                        f"NVIDIA driver {drv} runs CUDA up to {max_str}, torch needs "
                        f"{torch.version.cuda}: update the driver, or use a torch built for an "
                        f"older CUDA"
                    ),
                )
        rows.append(Check("driver", status, detail))
    if torch.version.cuda is None:
        rows.append(
            Check(
                "cuda / nccl",
                "skip",
                f"not checked: torch {torch.__version__} is a CPU build "
                f"(no CUDA runtime, no NCCL); gloo is the backend",
            )
        )
    else:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else None
        rows.append(
            Check(
                "cuda / nccl",
                "pass" if nccl else "warn",
                f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl or 'missing'}",
            )
        )
    return rows


def check_links(nvml) -> tuple[list[Check], float | None, str]:
    """Rows for GPU pair paths and PCIe links, plus the expected per-GPU link bandwidth (bytes/s) and its name."""
    rows = []
    expected, link_name = None, ""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        rows.append(Check("gpu paths", "skip", "not checked: nvidia-smi not found (no NVIDIA driver tools)"))
    else:
        try:
            out = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired) as e:
            out = ""
            rows.append(Check("gpu paths", "skip", f"not checked: nvidia-smi topo -m failed ({e})"))
        pairs = parse_topo_matrix(out)
        if pairs:
            worst = max(pairs.items(), key=lambda kv: ["pass", "warn"].index(path_verdict(kv[1])[0]))
            status = path_verdict(worst[1])[0]
            summary = ", ".join(f"{a}-{b} {code}" for (a, b), code in sorted(pairs.items())[:12])
            more = f" (+{len(pairs) - 12} pairs)" if len(pairs) > 12 else ""
            reason = "" if status == "pass" else f"; {worst[0][0]}-{worst[0][1]}: {path_verdict(worst[1])[1]}"
            rows.append(Check("gpu paths", status, summary + more + reason))
        elif out:
            rows.append(Check("gpu paths", "skip", "one GPU: no GPU pair to check"))
    if nvml is None:
        rows.append(Check("pcie / nvlink", "skip", "not checked: NVML unavailable"))
        return rows, None, ""
    details, status = [], "pass"
    nvlinks = 0
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        try:
            gen, width = nvml.nvmlDeviceGetCurrPcieLinkGeneration(h), nvml.nvmlDeviceGetCurrPcieLinkWidth(h)
            max_gen, max_width = nvml.nvmlDeviceGetMaxPcieLinkGeneration(h), nvml.nvmlDeviceGetMaxPcieLinkWidth(h)
        except Exception:
            continue
        active = 0
        for link in range(18):  # NVML_NVLINK_MAX_LINKS is 18 on Hopper
            try:
                active += nvml.nvmlDeviceGetNvLinkState(h, link) == 1
            except Exception:
                break
        nvlinks = max(nvlinks, active)
        # an idle GPU lowers its PCIe generation to save power, so only a narrower width is a fault
        if width < max_width:
            status = "warn"
            details.append(f"GPU{i} PCIe x{width} of x{max_width}: link trained narrower, check the slot/riser")
        else:
            details.append(f"GPU{i} PCIe gen{gen}/{max_gen} x{width}" + (f", {active} NVLinks" if active else ""))
        if expected is None:
            expected, link_name = pcie_bandwidth(max_gen, max_width), f"PCIe gen{max_gen} x{max_width}"
    if nvlinks:  # the catalog's sourced NVLink figure for this GPU model
        import torch

        from scaletrain.hardware.catalog import GPUS, LINKS
        from scaletrain.hardware.detect import catalog_name_for

        gpu = catalog_name_for(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None
        spec = LINKS.get(GPUS[gpu].default_intra_link) if gpu is not None and gpu in GPUS else None
        if spec and spec.name.startswith("nvlink"):
            expected, link_name = spec.bandwidth, spec.description
    rows.append(Check("pcie / nvlink", status, "; ".join(details[:8]) or "no PCIe data from NVML"))
    return rows, expected, link_name


def check_network() -> list[Check]:
    base = Path("/sys/class/infiniband")
    if not base.is_dir() or not any(base.iterdir()):
        return [
            Check(
                "infiniband / roce",
                "warn",
                "no InfiniBand or RoCE device (/sys/class/infiniband is empty "
                "or absent): traffic between nodes would go over TCP sockets",
            )
        ]
    ports: list[str] = []
    down: list[str] = []
    for dev in sorted(base.iterdir()):
        for port in sorted((dev / "ports").glob("*")):

            def read(name: str, port: Path = port) -> str:
                try:
                    return (port / name).read_text().strip()
                except OSError:
                    return "?"

            state, rate, layer = read("state"), read("rate"), read("link_layer")
            kind = "RoCE" if layer == "Ethernet" else layer
            label = f"{dev.name}/{port.name} {kind} {rate} {state.split(':')[-1].strip()}"
            (ports if "ACTIVE" in state else down).append(label)
    if not ports:
        return [Check("infiniband / roce", "fail", "no port ACTIVE: " + "; ".join(down))]
    return [Check("infiniband / roce", "warn" if down else "pass", "; ".join(ports + down))]


def check_memlock_and_files(has_rdma: bool) -> list[Check]:
    rows = []
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    rows.append(
        Check(
            "ulimit -n (open files)",
            "pass" if soft >= NOFILE_MIN else "warn",
            f"{soft} (hard {hard})"
            + ("" if soft >= NOFILE_MIN else f": below {NOFILE_MIN}; raise with `ulimit -n {min(hard, 65536)}`"),
        )
    )
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    shown = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft // 1024} KiB"
    if soft == resource.RLIM_INFINITY:
        rows.append(Check("ulimit -l (locked memory)", "pass", shown))
    elif has_rdma:
        rows.append(
            Check(
                "ulimit -l (locked memory)",
                "warn",
                f"{shown}: RDMA (InfiniBand/RoCE) registers memory and wants unlimited (`ulimit -l unlimited`)",
            )
        )
    else:
        rows.append(Check("ulimit -l (locked memory)", "pass", f"{shown} (enough without RDMA)"))
    return rows


def check_shm() -> list[Check]:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return [Check("/dev/shm", "fail", "/dev/shm is missing: NCCL and DataLoader workers need it")]
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    detail = f"{size / GIB:.1f} GiB, {free / GIB:.1f} GiB free"
    if size < SHM_MIN_BYTES:
        return [
            Check(
                "/dev/shm",
                "warn",
                f"{detail}: under {SHM_MIN_BYTES // GIB} GiB (containers: --shm-size or "
                f"--ipc=host; Kubernetes: a memory emptyDir on /dev/shm)",
            )
        ]
    return [Check("/dev/shm", "pass", detail)]


def check_allreduce(nproc: int, nbytes: int, expected: float | None, link_name: str) -> list[Check]:
    """A measured all-reduce across nproc local ranks (NCCL on GPUs, gloo on CPUs), against the link's speed."""
    import torch

    from scaletrain.launch.bench_local import measure_allreduce_busbw

    on_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= nproc
    backend = "nccl" if on_gpu else "gloo"
    try:
        busbw = measure_allreduce_busbw(nproc, nbytes)
    except Exception as e:  # a failed collective is itself the finding
        return [Check("all-reduce bus bandwidth", "fail", f"{nproc} {backend} ranks failed: {e}")]
    measured = f"{busbw / 1e9:.2f} GB/s over {nproc} {backend} ranks ({nbytes / 2**20:.0f} MiB)"
    if not on_gpu or expected is None:
        return [
            Check(
                "all-reduce bus bandwidth",
                "pass",
                f"{measured}; no link speed to compare with: CPU ranks over gloo use loopback and shared "
                f"memory, which have no datasheet figure",
            )
        ]
    share = busbw / expected
    status = "pass" if share >= BW_WARN_SHARE else "warn" if share >= BW_FAIL_SHARE else "fail"
    return [
        Check(
            "all-reduce bus bandwidth",
            status,
            f"{measured}: {share:.0%} of {link_name} ({expected / 1e9:.0f} GB/s per direction)",
        )
    ]


def check_nodes(nodes: int, node_rank: int, endpoint: str, nproc: int, nbytes: int) -> list[Check]:
    """The nodes meet at `endpoint` (one agent per node, as `train --nnodes`) and time all-reduce, all-gather and
    reduce-scatter over every rank of every node, then inside each node with every node at once (what
    `scaletrain bench --nodes` writes into a calibration). Rows: whether the nodes agree, and the bus bandwidths."""
    from scaletrain.hardware.fit import ring_terms
    from scaletrain.hardware.kernels import COLLECTIVES
    from scaletrain.hardware.internode import NodeBenchError, fit_seconds
    from scaletrain.launch.bench_nodes import measure_across_nodes

    name = f"{nodes} nodes at {endpoint}"
    try:
        points = measure_across_nodes(nodes, node_rank, endpoint, nproc, nbytes, amid=False)
    except NodeBenchError as e:
        return [Check("nodes agree", "fail", str(e))]
    except ValueError:  # the endpoint itself: bad input, for the command to refuse in one line
        raise
    except Exception as e:  # a rendezvous or collective that fails is itself the finding
        first = str(e).splitlines()[0] if str(e) else ""
        return [Check("inter-node bus bandwidth", "fail", f"{name}: {type(e).__name__}: {first}")]

    def figures(prefix: str, size: int) -> str:
        out = []
        for kind in COLLECTIVES:
            lat, busbw = fit_seconds(points[prefix + kind], *ring_terms(kind, size))
            out.append(f"{kind.replace('_', '-')} {busbw / 1e9:,.3f} GB/s + {lat * 1e6:.0f} us")
        return ", ".join(out)

    rows = [
        Check("nodes agree", "pass", f"{name}: same torch, scaletrain and --nproc {nproc} on every node"),
        Check(
            "inter-node bus bandwidth",
            "pass",
            f"over {nodes} x {nproc} ranks (one ring stream per node link): {figures('', nodes * nproc)}; write "
            f"them into a calibration with `scaletrain bench --nodes {nodes} ...`",
        ),
    ]
    if nproc > 1:
        rows.append(
            Check(
                "intra-node bus bandwidth", "pass", f"over {nproc} ranks, every node at once: {figures('node_', nproc)}"
            )
        )
    return rows


def run_doctor(bandwidth: bool = True, nproc: int | None = None, nbytes: int = 16 * 2**20) -> list[Check]:
    """Every check, in the order `scaletrain doctor` prints them."""
    import torch

    nvml, why = _nvml()
    rows = check_gpus(nvml)
    rows += check_versions(nvml)
    link_rows, expected, link_name = check_links(nvml)
    rows += link_rows
    net = check_network()
    rows += net
    rows += check_shm()
    has_rdma = Path("/sys/class/infiniband").is_dir() and any(Path("/sys/class/infiniband").iterdir())
    rows += check_memlock_and_files(has_rdma)
    if bandwidth:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        n = nproc or (gpus if gpus >= 2 else 2)
        rows += check_allreduce(n, nbytes, expected, link_name)
    else:
        rows.append(Check("all-reduce bus bandwidth", "skip", "not measured (--no-bandwidth)"))
    if nvml is not None:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    elif why and torch.version.cuda is not None:
        rows.append(Check("nvml", "skip", why))
    return rows
