"""The parallel-layout benchmarks run end to end (tiny settings; they are not tests of speed)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # launches every layout; refusals are test_parallel_plans.py's
def test_layouts_benchmark_runs_and_lists_refused_layouts():
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/layouts.py"),
            "--nproc",
            "2",
            "--steps",
            "2",
            "--seq-len",
            "64",
            "--only",
            "tp2,pp2",
            "--set",
            "model.n_kv_heads=1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {line.split()[0]: line for line in proc.stdout.splitlines()[2:] if line.strip()}
    assert set(lines) == {"tp2", "pp2"}
    assert "parallel.pp=2" in lines["pp2"] and "tokens" not in lines["pp2"]
    assert "parallel.tp: 2 does not divide model.n_kv_heads=1" in lines["tp2"]  # refused, with the reason


@pytest.mark.slow  # launches; the balanced split is test_parallel_plans.py's
def test_pp_balance_benchmark_runs():
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/pp_balance.py"),
            "--reps",
            "1",
            "--seq-len",
            "32",
            "--micro-batch",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "layers" in proc.stdout and "cost" in proc.stdout
