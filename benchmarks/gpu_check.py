"""Throughput on one GPU with what a user gets by default and with each precision/compile choice: the figures
issue 34 reported from the first H200 run, measured again by the real `scaletrain train` on this GPU, printed as a
Markdown table for BENCHMARKS.md (date and torch version in its heading).

    python benchmarks/gpu_check.py [--out DIR] [--steps 30] [--seq-len 2048] [--budget-s 300] [--dry-run]

Runs, in order (runs that would start past --budget-s are skipped and listed):
- default: `scaletrain train` with no settings (tiny model, 300 steps; dtype and compile "auto"), and the same in
  fp32 with compile off (what the default was before dtype=auto);
- llama-1b, seq --seq-len, synthetic tokens, one GPU, --steps steps: bf16 eager mb 4, bf16 compiled mb 4, fp8
  tensorwise eager mb 4 (refused: one line, exit 2 — the refusal is the check), fp8 tensorwise mb 4 with compile
  auto (compiled), bf16 compiled mb 8, fp8 tensorwise compiled mb 8, fp8 rowwise compiled mb 8, AC full eager mb 16;
- compile-auto: llama-1b bf16 mb 4 for 400 steps with compile auto: the probe times 3 eager steps and compiles when
  the steps left repay ~20 s of compilation (it should: ~400 x 225 ms x 24 % saved).
Tokens/s is the median of the logging windows after the first (compilation falls in the first); MFU against the
GPU's bf16 datasheet peak. --dry-run prints the commands without running them (no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

MODEL = "llama-1b"


@dataclass(frozen=True)
class Run:
    name: str
    settings: tuple[str, ...]
    refused: bool = False  # the check is that the trainer refuses it before launch (exit 2)


def llama(name: str, micro_batch: int, *settings: str, steps: int | None = None, refused: bool = False):
    def make(a) -> Run:
        return Run(
            name,
            (
                f"model.name={MODEL}",
                "data.source=synthetic",
                f"data.seq_len={a.seq_len}",
                f"train.steps={steps or a.steps}",
                f"train.global_batch_size={micro_batch}",
                f"train.micro_batch_size={micro_batch}",
                "train.eval_interval=0",
                "train.eval_batches=1",
                f"monitor.log_interval={max(1, (steps or a.steps) // 6)}",
                *settings,
            ),
            refused,
        )

    return make


RUNS = [
    lambda a: Run("default", ()),
    lambda a: Run("default-fp32-eager", ("precision.dtype=fp32", "parallel.compile=false")),
    llama("bf16-eager-mb4", 4, "precision.dtype=bf16", "parallel.compile=false"),
    llama("bf16-compile-mb4", 4, "precision.dtype=bf16", "parallel.compile=true"),
    llama("fp8-tensorwise-eager-mb4", 4, "precision.fp8=tensorwise", "parallel.compile=false", refused=True),
    llama("fp8-tensorwise-auto-mb4", 4, "precision.fp8=tensorwise"),
    llama("bf16-compile-mb8", 8, "precision.dtype=bf16", "parallel.compile=true"),
    llama("fp8-tensorwise-compile-mb8", 8, "precision.fp8=tensorwise", "parallel.compile=true"),
    llama("fp8-rowwise-compile-mb8", 8, "precision.fp8=rowwise", "parallel.compile=true"),
    llama(
        "bf16-acfull-eager-mb16",
        16,
        "precision.dtype=bf16",
        "parallel.activation_checkpoint=full",
        "parallel.compile=false",
    ),  # fmt: skip
    llama("bf16-compile-auto-mb4", 4, "precision.dtype=bf16", steps=400),
]


def command(run: Run, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "scaletrain.cli.main", "train", *run.settings, f"run.name={run.name}",
        f"run.output_dir={out / 'runs'}", "monitor.progress=false", "--nproc-per-node", "1",
    ]  # fmt: skip


def measure(run: Run, out: Path) -> dict:
    t0 = time.monotonic()
    proc = subprocess.run(command(run, out), capture_output=True, text=True)
    wall = time.monotonic() - t0
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    if run.refused:
        return {"refused": proc.returncode == 2, "line": last, "wall_s": wall}
    if proc.returncode != 0:
        return {"failed": last, "wall_s": wall}
    rows = [json.loads(x) for x in (out / "runs" / run.name / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if "tokens_per_s" in r]
    steady = timed[1:] or timed
    compile_lines = [x for x in proc.stderr.splitlines() if "compile" in x and ("auto:" in x or "took" in x)]
    start = next((x for x in proc.stderr.splitlines() if x.startswith("scaletrain: ")), "")
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "mfu": statistics.median(r["mfu"] for r in steady) if all("mfu" in r for r in steady) else None,
        "peak_gb": max(max(r.get("peak_mem_bytes_per_rank") or [0.0]) for r in timed) / 1e9,
        "wall_s": wall,
        "compile": " / ".join(x.split("] ")[-1] for x in compile_lines),
        "start": start.rsplit(",", 2)[-2:] if start else [],
    }


def table(rows: list[tuple[Run, dict]], skipped: list[str], seq_len: int, steps: int) -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    lines = [
        f"benchmarks/gpu_check.py on 1 x {gpu}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}: "
        f"llama-1b seq {seq_len}, {steps} steps, synthetic tokens (default: the tiny job, 300 steps)",
        "",
        "| run | tokens/s | MFU | peak GB | wall s | dtype, compile | compile log |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for run, r in rows:
        if "refused" in r:
            verdict = "refused before launch" if r["refused"] else "NOT refused"
            lines.append(f"| {run.name} | {verdict}: `{r['line']}` |||| | |")
        elif "failed" in r:
            lines.append(f"| {run.name} | failed: `{r['failed']}` |||| | |")
        else:
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "—"
            lines.append(
                f"| {run.name} | {r['tokens_per_s']:,.0f} | {mfu} | {r['peak_gb']:.1f} | {r['wall_s']:.0f} | "
                f"{','.join(r['start']).strip()} | {r['compile']} |"
            )
    if skipped:
        lines.append(f"\nskipped past --budget-s: {', '.join(skipped)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_check_out", help="folder for the runs and table.md")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--budget-s", type=float, default=300.0, help="skip runs that would start after this")
    ap.add_argument("--dry-run", action="store_true", help="print the commands; run nothing")
    a = ap.parse_args(argv)
    if a.steps < 12:
        ap.error(f"--steps: at least 12, to leave timed windows after the warm-up (got {a.steps})")
    if not 128 <= a.seq_len <= 8192:
        ap.error(f"--seq-len: between 128 and 8192 (got {a.seq_len})")
    out = Path(a.out)
    runs = [make(a) for make in RUNS]
    if a.dry_run:
        for run in runs:
            print(("[refused] " if run.refused else "") + " ".join(command(run, out)))
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_check.py: no CUDA GPU here; use --dry-run to check the arguments")
    out.mkdir(parents=True, exist_ok=True)
    start, rows, skipped = time.monotonic(), [], []
    for run in runs:
        if time.monotonic() - start > a.budget_s:
            skipped.append(run.name)
            continue
        rows.append((run, measure(run, out)))
        print(f"  {run.name}: {rows[-1][1]}", file=sys.stderr, flush=True)
    text = table(rows, skipped, a.seq_len, a.steps)
    (out / "table.md").write_text(text + "\n")
    print(text)
    print(f"total {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
