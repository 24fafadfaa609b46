"""benchmarks/finetune.py runs end to end on a miniature model (packed chat data, full and LoRA, one rep) and
writes its BENCHMARKS.md section; the ratios row is there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # two 2-rank launches and a data prepare
def test_finetune_benchmark_runs(tmp_path):
    report = tmp_path / "BENCHMARKS.md"
    report.write_text("# Benchmarks\n")
    argv = ["--dim", "64", "--layers", "1", "--seq-len", "32", "--steps", "2", "--reps", "1", "--conversations", "100"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/finetune.py"), *argv, "--markdown", str(report)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| full |" in proc.stdout and "| lora |" in proc.stdout and "| lora / full |" in proc.stdout
    text = report.read_text()
    assert "## Fine-tuning: LoRA against full, packed chat data" in text and "| lora / full |" in text
