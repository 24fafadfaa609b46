"""Shared helpers: run the real `scaletrain` command in a subprocess and read what a run wrote."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scaletrain.monitor import read_jsonl

# A small, fast job: tiny model, 300 kB of stdlib text, short sequences, a loss every step.
FAST = [
    "train.steps=10",
    "monitor.log_interval=1",
    "train.global_batch_size=16",
    "data.seq_len=64",
    "train.eval_batches=1",
    "data.max_bytes=300000",
    "train.warmup_steps=2",
    "monitor.progress=false",
]


def run_cli(
    args: list[str], cwd: Path, timeout: float = 600, check: bool = True, env: dict | None = None
) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "scaletrain.cli.main", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"scaletrain {' '.join(args)} exited {proc.returncode}\n{proc.stderr[-4000:]}")
    return proc


def run_cli_in_process(args: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    """The same `scaletrain` command, run by click in this process (in `cwd`) instead of a fresh interpreter: for
    commands that start no ranks (ckpt, report), saving the interpreter's and torch's import per call. An exception
    the command does not turn into an exit code propagates (it would have been a traceback)."""
    from click.testing import CliRunner

    from scaletrain.cli.main import main

    with contextlib.chdir(cwd):
        result = CliRunner().invoke(main, args, catch_exceptions=False)
    proc = subprocess.CompletedProcess(["scaletrain", *args], result.exit_code, result.stdout, result.stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"scaletrain {' '.join(args)} exited {proc.returncode}\n{proc.stderr[-4000:]}")
    return proc


def torchrun(nproc: int, args: list[str], cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`args` (a script and its arguments, or `-m module ...`) under torch's own agent on `nproc` local ranks with a
    free rendezvous port, the ranks forked from one process that imported torch and the script's imports
    (tests/rank_launcher.py), or as one plain process for nproc 1; one thread per rank; must exit 0."""
    cmd = [sys.executable, *args]
    if nproc > 1:
        cmd = [sys.executable, str(Path(__file__).resolve().parent / "rank_launcher.py"), str(nproc), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


def val_losses(run_dir: Path) -> list[float]:
    return [r["val_loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "val_loss" in r]


# `pytest -n auto` (pytest-xdist; README's commands and CI use it) runs test files side by side. Each file
# stays whole on one worker (its module-scoped launches are shared by its tests, never run twice), and the files that
# start simulated nodes or a Slurm share one worker, one after another. Heavy files go first, so the last file to
# start on a worker is a short one.
SERIAL_GROUP = "nodes"  # tests/cluster/ and the real single-node Slurm
SLOW_WEIGHT = 30  # a slow test costs ~30 fast ones (a launch of ranks against an in-process check)


def _group(item: pytest.Item) -> str:
    path = Path(str(item.fspath))
    if path.parent.name == "cluster" or path.name == "test_launch_slurm.py":
        return SERIAL_GROUP
    return path.name


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    groups = {item: _group(item) for item in items}
    weight: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, (item, group) in enumerate(groups.items()):
        weight[group] = weight.get(group, 0) + (SLOW_WEIGHT if item.get_closest_marker("slow") else 1)
        first.setdefault(group, i)
        item.add_marker(pytest.mark.xdist_group(group))
    # heaviest group first; within a group, collection order (a stable sort)
    items.sort(key=lambda item: (-weight[groups[item]], first[groups[item]]))


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: one worker per core this process may run on (a container's CPU set, not the host's count), at most
    4 (each worker's tests start up to 8 ranks of their own)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, 4))


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture(autouse=True)
def _no_process_group_left_behind(request):
    """A test that leaves torch's default process group initialised breaks a later in-process test of the full suite
    (the traced TP layout needs its own fake group): destroy it and say which test left it, in pytest's warnings."""
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        import warnings

        dist.destroy_process_group()
        warnings.warn(f"{request.node.nodeid} left torch's default process group initialised", stacklevel=1)
