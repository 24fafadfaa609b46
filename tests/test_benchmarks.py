"""Benchmarks are not tests: only check that each script runs end to end (2 steps)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_overhead_benchmark_runs():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/overhead.py"), "--reps", "1", "--steps", "2",
                           "--log-every", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "plain torch" in proc.stdout and "scaletrain" in proc.stdout
