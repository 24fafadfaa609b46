"""The planner against single-GPU training on the GPU this runs on: `scaletrain bench` first, then llama-1b (bf16)
for a few micro-batch sizes, activation checkpointing modes and compile off / on, each with its measured step time
and peak allocated memory (torch.cuda.max_memory_allocated) next to the planner's prediction for that layout,
printed as a Markdown table for BENCHMARKS.md.

    python benchmarks/gpu_planner.py [--out DIR] [--runs none:1,none:2,...] [--steps 12] [--seq-len 2048]
                                     [--budget-s 420] [--dry-run]

A run is AC:MICRO_BATCH[:compile]; the default list fits under 8 minutes on one H200 (most of it start-up and
compilation). Each run is the real `scaletrain train` on one GPU (global batch = micro-batch, synthetic tokens);
the step time is the median over the logging windows after the first. Predictions: the planner on one GPU of the
detected catalog type with the bench calibration; memory predicted without the CUDA context and fragmentation
lines, which max_memory_allocated does not count. Runs past --budget-s are skipped and listed. --dry-run checks
the arguments and prints the commands and the planner's uncalibrated predictions without running anything
(no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from scaletrain.config import load_config
from scaletrain.hardware import apply_calibration, load_calibration, make_cluster
from scaletrain.models import preset_spec
from scaletrain.plan import Layout, Workload, evaluate_layout
from scaletrain.plan.layout import AC_MODES
from scaletrain.resolve import resolve_job

MODEL = "llama-1b"
DEFAULT_RUNS = "none:1,none:2,none:4,selective:4,full:4,none:2:compile,full:4:compile"
NOT_ALLOCATED = ("CUDA context", "fragmentation")  # memory lines max_memory_allocated does not see


@dataclass(frozen=True)
class Run:
    ac: str
    micro_batch: int
    compile: bool

    @property
    def name(self) -> str:
        return f"{self.ac}-mb{self.micro_batch}" + ("-compile" if self.compile else "")


def parse_runs(text: str) -> list[Run]:
    """AC:MICRO_BATCH[:compile], comma-separated; ValueError names the bad item."""
    runs = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        parts = item.split(":")
        if len(parts) not in (2, 3) or parts[0] not in AC_MODES or not parts[1].isdigit():
            raise ValueError(f"--runs: {item!r} is not AC:MICRO_BATCH[:compile] with AC none, selective or full")
        if len(parts) == 3 and parts[2] != "compile":
            raise ValueError(f"--runs: {item!r}: the third part can only be 'compile'")
        if not 1 <= int(parts[1]) <= 64:
            raise ValueError(f"--runs: {item!r}: micro-batch between 1 and 64")
        runs.append(Run(parts[0], int(parts[1]), len(parts) == 3))
    if not runs:
        raise ValueError("--runs: give at least one AC:MICRO_BATCH")
    return runs


def overrides(run: Run, a) -> list[str]:
    return [
        f"model.name={MODEL}",
        "data.source=synthetic",
        f"data.seq_len={a.seq_len}",
        f"train.steps={a.steps}",
        f"train.global_batch_size={run.micro_batch}",
        f"train.micro_batch_size={run.micro_batch}",
        "train.eval_interval=0",
        "precision.dtype=bf16",
        f"parallel.activation_checkpoint={run.ac}",
        f"parallel.compile={'true' if run.compile else 'false'}",
        f"monitor.log_interval={max(1, a.steps // 4)}",
        "monitor.progress=false",
        f"run.name={run.name}",
    ]


def predicted(run: Run, a, cluster) -> tuple[float, float]:
    """(step seconds, bytes max_memory_allocated should reach) the planner predicts for `run`."""
    work = Workload(MODEL, preset_spec(MODEL).shape(), a.seq_len, run.micro_batch, compile=run.compile)
    row = evaluate_layout(work, cluster, Layout(1, 1, 1, 1, 1, run.micro_batch, 1, run.ac, "bf16", "none"))
    return row.step_s, row.memory_total - sum(row.memory.get(k, 0.0) for k in NOT_ALLOCATED)


def measure(run: Run, a, workdir: Path) -> dict:
    cmd = [sys.executable, "-m", "scaletrain.cli.main", "train", *overrides(run, a), "--nproc-per-node", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=workdir)
    if proc.returncode != 0:
        return {"failed": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    rows = [json.loads(x) for x in (workdir / "runs" / run.name / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if "step_time_s" in r]
    peaks = [max(r.get("peak_mem_bytes_per_rank") or [0.0]) for r in timed]
    return {"step_s": statistics.median(r["step_time_s"] for r in timed[1:] or timed), "peak_bytes": max(peaks)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_planner_out", help="folder for the calibration, runs and table")
    ap.add_argument("--runs", default=DEFAULT_RUNS, help="AC:MICRO_BATCH[:compile], comma-separated")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip runs that would start after this")
    ap.add_argument("--gpu", default="", help="catalog GPU for the planner (default: the detected one)")
    ap.add_argument("--dry-run", action="store_true", help="print commands and predictions; run nothing")
    a = ap.parse_args(argv)
    try:
        runs = parse_runs(a.runs)
    except ValueError as e:
        ap.error(str(e))
    if a.steps < 4:
        ap.error(f"--steps: at least 4, to leave timed windows after the warm-up (got {a.steps})")
    if not 128 <= a.seq_len <= preset_spec(MODEL).shape().max_seq_len:
        ap.error(f"--seq-len: between 128 and {preset_spec(MODEL).shape().max_seq_len} (got {a.seq_len})")
    out = Path(a.out)
    if out.exists() and not out.is_dir():
        ap.error(f"--out: {a.out!r} is a file; give a folder")

    from scaletrain.hardware import detect_host

    host = detect_host()
    gpu = a.gpu or (host.catalog_gpu if host.gpu_count else "h200")
    try:
        cluster = make_cluster(gpu, 1)
    except ValueError as e:
        ap.error(str(e).replace("--gpu:", "--gpu"))
    for run in runs:  # the trainer's own pre-launch checks, so that no GPU time goes to a refused config
        try:
            resolve_job(load_config(None, overrides(run, a)), 1)
        except ValueError as e:
            ap.error(f"{run.name}: {e}")
    if a.dry_run:
        print(f"dry run: planner on 1 x {gpu}, catalog figures (no bench); commands that would run:")
        print(f"  {sys.executable} -m scaletrain.cli.main bench --nproc 1 -o {out / 'calibration.toml'}")
        for run in runs:
            step, mem = predicted(run, a, cluster)
            print(f"  [{run.name}: predicted {step * 1e3:.0f} ms, {mem / 1e9:.1f} GB] scaletrain train "
                  + " ".join(overrides(run, a)) + " --nproc-per-node 1")  # fmt: skip
        return
    if not host.gpu_count:
        sys.exit("gpu_planner.py: no CUDA GPU here; use --dry-run to check the arguments")
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    cal_path = out / "calibration.toml"
    env = {**os.environ}
    bench = [sys.executable, "-m", "scaletrain.cli.main", "bench", "--nproc", "1", "-o", str(cal_path)]
    p = subprocess.run(bench, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"scaletrain bench failed: {(p.stderr.strip().splitlines() or ['no output'])[-1]}")
    print(p.stdout.strip(), flush=True)
    cluster = apply_calibration(cluster, load_calibration(cal_path))
    rows, skipped = [], []
    for run in runs:
        if time.monotonic() - start > a.budget_s:
            skipped.append(run.name)
            continue
        r = measure(run, a, out)
        rows.append((run, r, *predicted(run, a, cluster)))
        print(f"  {run.name}: {r}", file=sys.stderr, flush=True)
    lines = [
        f"llama-1b, bf16, seq {a.seq_len}, 1 x {host.gpu_names[0] if host.gpu_names else gpu}, {a.steps} steps, "
        f"planner calibrated by `scaletrain bench` ({time.strftime('%Y-%m-%d')})",
        "",
        "| AC | micro-batch | compile | measured ms | predicted ms | error | measured GB | predicted GB | error |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run, r, step, mem in rows:
        if "failed" in r:
            lines.append(f"| {run.ac} | {run.micro_batch} | {run.compile} | failed: {r['failed']} ||||||")
            continue
        lines.append(
            f"| {run.ac} | {run.micro_batch} | {'on' if run.compile else 'off'} | {r['step_s'] * 1e3:.1f} | "
            f"{step * 1e3:.1f} | {step / r['step_s'] - 1:+.1%} | {r['peak_bytes'] / 1e9:.2f} | {mem / 1e9:.2f} | "
            f"{mem / r['peak_bytes'] - 1:+.1%} |"
        )
    if skipped:
        lines.append(f"\nskipped past --budget-s {a.budget_s:.0f}: {', '.join(skipped)}")
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    print(table)
    print(f"total {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
