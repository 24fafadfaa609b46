"""`scaletrain.setup()` on a user's own model and loop, as the documented example runs it under torchrun."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_loop.py"


def _run(args, nproc):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if nproc == 1:
        cmd = [sys.executable, str(EXAMPLE), *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "127.0.0.1:0",
            str(EXAMPLE),
            *args,
        ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [float(x) for x in re.findall(r"loss ([0-9.]+)", proc.stdout)]


@pytest.mark.parametrize("args, nproc", [([], 1), (["ddp"], 2), (["fsdp", "fp16"], 2)])
def test_custom_loop_trains(args, nproc):
    got = _run(args, nproc)
    assert len(got) == 4
    assert got[-1] < got[0] / 3
