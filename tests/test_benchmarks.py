"""Benchmarks are not tests: only check that each script runs end to end (2 steps)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_overhead_benchmark_runs():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/overhead.py"), "--reps", "1", "--steps", "2",
                           "--log-every", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "plain torch" in proc.stdout and "scaletrain" in proc.stdout


@pytest.mark.slow
def test_peers_benchmark_runs(tmp_path):
    """Every runner (scaletrain DDP/FSDP, torch DDP/FSDP2, Accelerate, Fabric) trains 2 steps and the report renders."""
    report = tmp_path / "BENCHMARKS.md"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/peers.py"), "--reps", "1", "--steps", "2",
                           "--log-every", "1", "--markdown", str(report), "--cprofile", "1:2", "--profile-dir",
                           str(tmp_path / "prof")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for runner in ("scaletrain-ddp", "torch-ddp", "accelerate-ddp", "fabric-ddp", "scaletrain-fsdp", "torch-fsdp2"):
        assert f"| {runner} |" in proc.stdout
        assert (tmp_path / "prof" / f"{runner}.pstats").is_file()  # rank 0's profile of step 2, every runner
    assert "own time ms/step" in proc.stdout
    assert "| torch-ddp |" in report.read_text() and "benchmarks/peers.py" in report.read_text()
