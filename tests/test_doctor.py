"""`scaletrain doctor`: on this CPU host it passes what it can check, measures a gloo all-reduce, and says plainly
what it could not check; GPU-side logic (topology matrix, PCIe width, other processes) is fed recorded inputs."""

from __future__ import annotations

import json
from types import SimpleNamespace

from click.testing import CliRunner

from scaletrain.cli.main import main
from scaletrain.doctor import checks
from scaletrain.doctor.topology import parse_topo_matrix, path_verdict, pcie_bandwidth

# `nvidia-smi topo -m` on an 8-GPU HGX node, trimmed to 4 GPUs and 2 NICs (format of driver 535+)
TOPO = """\
\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m
GPU0\t X \tNV18\tNV18\tSYS\tPXB\tSYS\t0-55,112-167\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tSYS\tSYS\tPXB\t0-55,112-167\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tNV18\tSYS\tSYS\t56-111\t1\t\tN/A
GPU3\tSYS\tSYS\tNV18\t X \tSYS\tSYS\t56-111\t1\t\tN/A
NIC0\tPXB\tSYS\tSYS\tSYS\t X \tSYS
NIC1\tSYS\tPXB\tSYS\tSYS\tSYS\t X

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NV#  = Connection traversing a bonded set of # NVLinks

NIC Legend:

  NIC0: mlx5_0
  NIC1: mlx5_1
"""


def test_doctor_on_this_host_reports_every_check_and_what_it_could_not_see() -> None:
    res = CliRunner().invoke(main, ["doctor"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    lines = res.output.strip().splitlines()
    names = (
        "gpus visible",
        "driver",
        "cuda / nccl",
        "gpu paths",
        "pcie / nvlink",
        "infiniband / roce",
        "/dev/shm",
        "ulimit -n",
        "ulimit -l",
        "all-reduce bus bandwidth",
    )
    for name in names:
        assert any(name in ln for ln in lines), name
    assert all(ln[:4] in ("PASS", "WARN", "FAIL", "SKIP") for ln in lines[:-1])
    bw = next(ln for ln in lines if "all-reduce" in ln)
    assert bw.startswith("PASS") and "GB/s over 2 gloo ranks" in bw
    assert lines[-1].endswith("not checked")

    res = CliRunner().invoke(main, ["doctor", "--json", "--no-bandwidth"], catch_exceptions=False)
    rows = json.loads(res.output)
    assert {r["status"] for r in rows} <= {"pass", "warn", "fail", "skip"}
    for row in rows:
        assert row["detail"]  # every status carries its reason
        if row["status"] == "skip":
            assert "not checked" in row["detail"] or "not measured" in row["detail"]


def test_topology_matrix_and_link_math() -> None:
    pairs = parse_topo_matrix(TOPO)
    assert pairs == {
        ("GPU0", "GPU1"): "NV18",
        ("GPU0", "GPU2"): "NV18",
        ("GPU0", "GPU3"): "SYS",
        ("GPU1", "GPU2"): "NV18",
        ("GPU1", "GPU3"): "SYS",
        ("GPU2", "GPU3"): "NV18",
    }
    assert path_verdict("NV18") == ("pass", "NVLink x18")
    assert path_verdict("SYS")[0] == "warn" and path_verdict("PIX")[0] == "pass"
    assert parse_topo_matrix("No devices were found") == {}
    assert abs(pcie_bandwidth(4, 16) - 31.5e9) < 0.1e9  # PCIe 4.0 x16: ~31.5 GB/s per direction
    assert abs(pcie_bandwidth(5, 16) - 63.0e9) < 0.1e9
    assert pcie_bandwidth(9, 16) is None


class FakeNVML(SimpleNamespace):
    """Two GPUs: GPU1 trained at x8 of x16 and used by another process."""

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=4321, usedGpuMemory=3 * 2**30)] if h == 1 else []

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):
        return []

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return 1  # idle GPUs drop the generation: not a fault

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return 8 if h == 1 else 16

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return 4

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return 16

    def nvmlDeviceGetNvLinkState(self, h, link):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")


def test_pcie_width_and_sharing_with_recorded_nvml(monkeypatch) -> None:
    monkeypatch.setattr(checks.shutil, "which", lambda name: None)  # no nvidia-smi
    rows, expected, link = checks.check_links(FakeNVML())
    pcie = next(r for r in rows if r.name == "pcie / nvlink")
    assert pcie.status == "warn" and "GPU1 PCIe x8 of x16" in pcie.detail and "GPU0 PCIe gen1/4 x16" in pcie.detail
    assert link == "PCIe gen4 x16" and abs(expected - 31.5e9) < 0.1e9

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H100 80GB HBM3")
    rows = {r.name: r for r in checks.check_gpus(FakeNVML())}
    assert rows["gpus visible"].status == "pass" and "2 x NVIDIA H100" in rows["gpus visible"].detail
    assert rows["gpus not shared"].status == "warn" and "pid 4321" in rows["gpus not shared"].detail


def test_doctor_across_nodes_refuses_flags_that_do_not_go_together_in_one_line() -> None:
    """`doctor --nodes` (run across simulated nodes in tests/cluster/test_bench_nodes.py): flags that cannot meet
    are one line and exit 2, before any local check runs."""
    cases = {
        ("--nodes", "2"): "also give --node-rank 0..1 and --rdzv-endpoint HOST:PORT on every node",
        ("--node-rank", "0"): "only with --nodes N (N >= 2); drop them for a one-node doctor",
        ("--nodes", "2", "--node-rank", "2", "--rdzv-endpoint", "10.0.0.1:29500"): "is not below --nodes 2",
        ("--nodes", "2", "--node-rank", "0", "--rdzv-endpoint", "nohostport"): "'nohostport' is not host:port",
    }
    for args, message in cases.items():
        res = CliRunner().invoke(main, ["doctor", *args])
        assert res.exit_code == 2, (args, res.output)
        assert message in res.output and len(res.output.strip().splitlines()) == 1, res.output
        assert "--rdzv-endpoint" in res.output or "--node" in res.output
