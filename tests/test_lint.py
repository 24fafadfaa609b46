"""The code passes its own checks: ruff's lint rules and format, and the type checker on src/ (configured in
pyproject.toml). Part of the suite, so the one test command README gives (and CI runs) enforces them."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "command",
    [
        ["ruff", "check", "--no-cache", "."],
        ["ruff", "format", "--check", "--no-cache", "."],
        # a minute or more of type checking: the full suite's (and run by hand before a commit); ruff stays fast
        pytest.param(["mypy", "--no-incremental"], marks=pytest.mark.slow),
    ],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_checks_pass(command):
    proc = subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(command)}:\n{proc.stdout[-6000:]}{proc.stderr[-2000:]}"
