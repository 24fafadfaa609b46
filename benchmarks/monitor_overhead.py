"""Monitoring overhead: `scaletrain train` with the monitor's metrics and sampling off against the defaults (step-time
breakdown + per-rank all-gather at log steps, MFU, TensorBoard events, device sampling), same job, 2 CPU ranks (DDP
over gloo). Runs alternate (off on off on ...) so drift on a shared machine hits both.

    python benchmarks/monitor_overhead.py [--reps 3] [--steps 60] [--sample-interval 1.0]

Prints the median step time of each (first logging window dropped as warm-up) and the ratio on / off
(target <= 1.02). On a loaded machine whole-run step times drift by more than that, so it also prints the
in-process cost of the monitor's per-step work (phase timers and gradient-ready hooks on the same model, timed
in a tight loop) as a share of the measured step: a bound that load does not blur.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

OFF = ["monitor.breakdown=false", "monitor.tensorboard=false", "monitor.sample_interval_s=0"]


def run(a, env, workdir: Path, monitor: list[str]) -> list[float]:
    cmd = [
        sys.executable,
        "-m",
        "scaletrain.cli.main",
        "train",
        f"model.name={a.model}",
        f"train.steps={a.steps}",
        f"monitor.log_interval={a.log_every}",
        f"data.seq_len={a.seq_len}",
        f"train.global_batch_size={a.global_batch}",
        "data.max_bytes=1000000",
        "parallel.dp_replicate=2",
        "train.eval_interval=0",
        "train.eval_batches=1",
        "monitor.progress=false",
        "run.name=bench",
        *monitor,
    ]
    subprocess.run(cmd, capture_output=True, text=True, env=env, check=True, cwd=workdir)
    rows = [json.loads(x) for x in (workdir / "runs/bench/metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in rows if "step_time_s" in r][1:]


def per_step_cost_s(model_name: str, reps: int = 2000) -> float:
    """Seconds of monitor work per training step: 4 phase enter/exits plus one grad-ready hook call per
    parameter, on the real model's parameter count."""
    import time

    import torch

    from scaletrain.models import preset_spec
    from scaletrain.monitor.timing import StepTimer

    n_params = sum(1 for _ in preset_spec(model_name).build("meta").parameters())
    timer = StepTimer(torch.device("cpu"))
    t0 = time.perf_counter()
    for _ in range(reps):
        for name in ("data", "forward", "backward", "optimizer"):
            with timer.phase(name):
                if name == "backward":
                    for _ in range(n_params):
                        timer._grad_ready(None)
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--sample-interval", type=float, default=1.0)
    a = ap.parse_args()
    if a.steps < 2 * a.log_every:
        a.log_every = max(1, a.steps // 2)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    on = ["monitor.breakdown=true", "monitor.tensorboard=true", f"monitor.sample_interval_s={a.sample_interval}"]
    off, with_mon = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(a.reps):
            off += run(a, env, Path(tmp), OFF)
            with_mon += run(a, env, Path(tmp), on)
    tokens = a.global_batch * a.seq_len
    p, s = statistics.median(off), statistics.median(with_mon)
    print(
        f"model {a.model}, 2 CPU ranks (gloo, DDP), {a.steps} steps x {a.global_batch} x {a.seq_len} tokens, "
        f"log every {a.log_every}, sampling every {a.sample_interval:g} s, {a.reps} alternating reps"
    )
    print(f"{'monitor':<12}{'median step (ms)':>18}{'tokens/s':>12}{'ratio':>8}")
    print(f"{'off':<12}{p * 1e3:>18.1f}{tokens / p:>12,.0f}{1.0:>8.3f}")
    print(f"{'on':<12}{s * 1e3:>18.1f}{tokens / s:>12,.0f}{s / p:>8.3f}")
    c = per_step_cost_s(a.model)
    print(
        f"per-step monitor work in process: {c * 1e6:.1f} us = {c / p:.5f} of the median step "
        f"(ratio bound {1 + c / p:.4f}; log steps add one all-gather and a JSONL/TensorBoard write)"
    )


if __name__ == "__main__":
    main()
