"""scaletrain's own overhead: `scaletrain train` (DDP) against a hand-written torch DDP loop, same model, data,
global batch and steps, 2 CPU ranks over gloo. Runs alternate (A B A B ...) so drift on a shared machine hits both.

    python benchmarks/overhead.py [--reps 3] [--steps 60] [--model tiny]

Prints the median step time of each (first logging window dropped as warm-up) and the ratio scaletrain / plain.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_plain(a, env) -> list[float]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:0",
        str(HERE / "plain_ddp.py"),
        "--model",
        a.model,
        "--steps",
        str(a.steps),
        "--log-every",
        str(a.log_every),
        "--seq-len",
        str(a.seq_len),
        "--global-batch",
        str(a.global_batch),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["window_step_time_s"][1:]


def run_scaletrain(a, env, workdir: Path) -> list[float]:
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
    ]
    subprocess.run(cmd, capture_output=True, text=True, env=env, check=True, cwd=workdir)
    rows = [json.loads(x) for x in (workdir / "runs/bench/metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in rows if "step_time_s" in r][1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=16)
    a = ap.parse_args()
    if a.steps < 2 * a.log_every:
        a.log_every = max(1, a.steps // 2)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    plain, ours = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(a.reps):
            plain += run_plain(a, env)
            ours += run_scaletrain(a, env, Path(tmp))
    tokens = a.global_batch * a.seq_len
    p, s = statistics.median(plain), statistics.median(ours)
    print(
        f"model {a.model}, 2 CPU ranks (gloo, DDP), {a.steps} steps x {a.global_batch} x {a.seq_len} tokens, "
        f"{a.reps} alternating reps"
    )
    print(f"{'runner':<12}{'median step (ms)':>18}{'tokens/s':>12}{'ratio':>8}")
    print(f"{'plain torch':<12}{p * 1e3:>18.1f}{tokens / p:>12,.0f}{1.0:>8.3f}")
    print(f"{'scaletrain':<12}{s * 1e3:>18.1f}{tokens / s:>12,.0f}{s / p:>8.3f}")


if __name__ == "__main__":
    main()
