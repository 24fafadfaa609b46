"""benchmarks/finetune.py runs end to end on a miniature model (packed and padded chat data, full, LoRA and QLoRA,
one rep; the TRL row left out) and writes its BENCHMARKS.md section; the ratio rows are there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # four 2-rank launches and a data prepare
def test_finetune_benchmark_runs(tmp_path):
    report = tmp_path / "BENCHMARKS.md"
    report.write_text("# Benchmarks\n")
    # dim 512: the smallest of the benchmark's shapes whose k projection (2 kv heads) is whole NF4 blocks per shard
    argv = ["--dim", "512", "--layers", "1", "--seq-len", "128", "--steps", "2", "--reps", "1", "--conversations", "60"]
    argv += ["--no-trl"]  # TRL's own start-up costs more than the whole check; its row is the benchmark's
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/finetune.py"), *argv, "--markdown", str(report)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| full |" in proc.stdout and "| lora |" in proc.stdout and "| lora / full |" in proc.stdout
    assert "| qlora |" in proc.stdout and "| qlora / lora |" in proc.stdout
    assert "| packed / padded |" in proc.stdout and "TRL row skipped: left out (--no-trl)" in proc.stdout
    text = report.read_text()
    assert "## Fine-tuning: packed against padded, LoRA against full, scaletrain against TRL" in text
    assert "| lora / full |" in text and "| packed / padded |" in text
