"""Every parallel layout that fits N CPU ranks (default 4) for one model, measured side by side: the real
`scaletrain train` per layout (gloo, fp32), median step time and tokens/s over the logging windows after the
first (warm-up). Layouts the trainer refuses before launch are listed with the reason. This table is what the
planner's step-time model is held against.

    python benchmarks/layouts.py [--nproc 4] [--model tiny] [--steps 30] [--seq-len 256] [--global-batch 16]
                                 [--json OUT.json] [--only fsdp4,tp2_pp2] [--set model.n_layers=8 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from scaletrain.config import load_config
from scaletrain.resolve import resolve_job


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(world: int) -> dict[str, list[str]]:
    """name -> parallel overrides, for every dp_replicate x dp_shard x tp x pp = world (pipelines run 1F1B;
    TP runs with sequence parallelism, as one would on GPUs)."""
    out = {}
    for pp in divisors(world):
        for tp in divisors(world // pp):
            dp = world // (pp * tp)
            for rep in divisors(dp):
                shard = dp // rep
                parts = []
                if rep > 1 and shard > 1:
                    parts.append(f"hsdp{rep}x{shard}")
                elif shard > 1:
                    parts.append(f"fsdp{shard}")
                elif rep > 1:
                    parts.append(f"ddp{rep}")
                if tp > 1:
                    parts.append(f"tp{tp}")
                if pp > 1:
                    parts.append(f"pp{pp}")
                over = [
                    f"parallel.dp_replicate={rep}",
                    f"parallel.dp_shard={shard}",
                    f"parallel.tp={tp}",
                    f"parallel.pp={pp}",
                ]
                if tp > 1:
                    over.append("parallel.sequence_parallel=true")
                out["_".join(parts) or "single"] = over
    return out


def run(name: str, overrides: list[str], a, workdir: Path) -> dict:
    base = [
        f"model.name={a.model}",
        f"train.steps={a.steps}",
        f"monitor.log_interval={a.log_every}",
        f"data.seq_len={a.seq_len}",
        f"train.global_batch_size={a.global_batch}",
        "data.max_bytes=1000000",
        "train.eval_interval=0",
        "train.eval_batches=1",
        "monitor.progress=false",
        f"run.name={name}",
        *a.set,
    ]
    try:
        resolve_job(load_config(None, base + overrides), a.nproc)
    except ValueError as e:
        return {"layout": name, "refused": str(e)}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "scaletrain.cli.main", "train", *base, *overrides, "--nproc-per-node", str(a.nproc)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=workdir)
    if proc.returncode != 0:
        return {"layout": name, "failed": proc.stderr.strip().splitlines()[-1]}
    rows = [json.loads(x) for x in (workdir / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r][1:]
    step = statistics.median(times)
    return {
        "layout": name,
        "overrides": " ".join(overrides),
        "step_time_s": step,
        "tokens_per_s": a.global_batch * a.seq_len / step,
        "final_loss": [r["loss"] for r in rows if "loss" in r][-1],
    }


def run_arguments(description: str) -> argparse.ArgumentParser:
    """The job and layout options shared by this benchmark and planner_vs_measured.py."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--only", default="", help="comma-separated layout names")
    ap.add_argument("--set", action="append", default=[], help="an extra config override for every run")
    return ap


def parse_run_arguments(ap: argparse.ArgumentParser) -> argparse.Namespace:
    a = ap.parse_args()
    if a.steps < 2 * a.log_every:
        a.log_every = max(1, a.steps // 2)
    known = layouts(a.nproc)
    unknown = [n for n in a.only.split(",") if n and n not in known]
    if unknown:
        ap.error(f"--only: unknown layout {unknown[0]!r} for {a.nproc} ranks; choose from {', '.join(known)}")
    return a


def measured_runs(a: argparse.Namespace):
    """Run every layout (or those --only names) in a scratch folder; yields (overrides, result row) as each ends."""
    chosen = {k: v for k, v in layouts(a.nproc).items() if not a.only or k in a.only.split(",")}
    with tempfile.TemporaryDirectory() as tmp:
        for name, over in chosen.items():
            r = run(name, over, a, Path(tmp))
            print(f"  {name}: done", file=sys.stderr, flush=True)
            yield over, r


def main() -> None:
    ap = run_arguments(__doc__)
    ap.add_argument("--json", default="", help="also write the rows to this file")
    a = parse_run_arguments(ap)
    rows = [r for _, r in measured_runs(a)]
    print(
        f"model {a.model}, {a.nproc} CPU ranks (gloo, fp32), {a.steps} steps x {a.global_batch} x {a.seq_len} "
        f"tokens; median step over logging windows after the first"
    )
    print(f"{'layout':<18}{'step (ms)':>11}{'tokens/s':>11}{'loss':>8}  overrides / why not")
    ok = sorted((r for r in rows if "step_time_s" in r), key=lambda r: r["step_time_s"])
    for r in ok:
        print(
            f"{r['layout']:<18}{r['step_time_s'] * 1e3:>11.1f}{r['tokens_per_s']:>11,.0f}{r['final_loss']:>8.3f}  "
            f"{r['overrides']}"
        )
    for r in rows:
        if "step_time_s" not in r:
            print(f"{r['layout']:<18}{'-':>11}{'-':>11}{'-':>8}  {r.get('refused') or 'FAILED: ' + r['failed']}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
