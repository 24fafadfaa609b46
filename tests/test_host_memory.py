"""CPU ranks keep freed memory for the next step instead of taking it back from the kernel through page faults
(parallel/runtime.py keep_freed_host_memory, which init_distributed calls on CPU)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

# a step's worth of churn: MiB-sized buffers freed and allocated again, as activations and gradients are
CHURN = """
import json, resource, sys, torch
from scaletrain.parallel.runtime import keep_freed_host_memory
if sys.argv[1] == "scaletrain":
    assert keep_freed_host_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    [torch.ones(1 << 20) for _ in range(8)]
before = faults()
for _ in range(20):
    [torch.ones(1 << 20) for _ in range(8)]
print(json.dumps(faults() - before))
"""


def _faults(mode: str, **env: str) -> int:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run(
        [sys.executable, "-c", CHURN, mode],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds only")
def test_cpu_ranks_reuse_freed_memory_without_page_faults():
    # 20 rounds of 8 x 4 MiB (8,192 pages a round). glibc's defaults give a round back to the kernel or not
    # depending on where the heap's top lies (0 or ~5,000 faults a round seen here), so only the kept side is checked
    assert _faults("scaletrain") < 500


def test_a_users_own_malloc_settings_are_left_alone(monkeypatch):
    from scaletrain.parallel.runtime import keep_freed_host_memory

    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert not keep_freed_host_memory()
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")
    assert not keep_freed_host_memory()
