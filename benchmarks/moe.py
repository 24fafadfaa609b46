"""Expert parallelism vs FSDP alone on the same mixture-of-experts model and ranks: the real `scaletrain train`
per variant (gloo CPU ranks, fp32, or whatever `--set` asks), median step time over the logging windows after the
first (warm-up), peak memory per rank (the trainer's own peak_mem_bytes_per_rank: the device's peak on CUDA, the
process's peak RSS on CPU), and the all-to-all bytes the dispatchers measured (moe_a2a_bytes: hidden states sent to
other ranks, dispatch + combine, forward) against a uniform-routing prediction,
2 x tokens x top_k x dim x bytes per element x (ep - 1) / ep x MoE layers per step (backward sends as much again).
The planner does not model expert parallelism yet; this prediction is the formula it would start from.

    python benchmarks/moe.py [--nproc 4] [--ep 2,4] [--model moe-small] [--steps 20] [--seq-len 256]
                             [--global-batch 16] [--set model.n_experts=32 ...] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from scaletrain.config import load_config
from scaletrain.models.registry import model_spec


def run(name: str, overrides: list[str], nproc: int, out: Path) -> dict:
    """One `scaletrain train` launch; its metrics.jsonl summarised."""
    cmd = [sys.executable, "-m", "scaletrain.cli.main", "train", *overrides, f"run.name={name}"]
    cmd += [f"run.output_dir={out}", "--nproc-per-node", str(nproc)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"name": name, "error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    records = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    after_warmup = records[1:] or records
    return {
        "name": name,
        "step_time_s": statistics.median(r["step_time_s"] for r in after_warmup),
        "peak_mem_mib": max(max(r.get("peak_mem_bytes_per_rank") or [0]) for r in records) / 2**20,
        "a2a_bytes_per_step": statistics.median(r.get("moe_a2a_bytes", 0.0) for r in after_warmup),
        "imbalance": statistics.median(r.get("moe_imbalance", 0.0) for r in after_warmup),
        "final_loss": records[-1]["loss"],
    }


def predicted_a2a_bytes(overrides: list[str], ep: int) -> float:
    """Uniform routing: of each token's top_k pairs, (ep - 1) / ep leave the rank, to be sent there and back."""
    cfg = load_config(None, overrides)
    args = model_spec(cfg.model).args
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    element = 2 if cfg.precision.dtype in ("bf16", "fp16") else 4
    moe_layers = args.n_layers - args.n_dense_layers
    return 2.0 * tokens * args.top_k * args.dim * element * (ep - 1) / ep * moe_layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--ep", default="2,4", help="expert-parallel degrees to compare with FSDP alone")
    ap.add_argument("--model", default="moe-small")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--set", nargs="*", default=[], help="more key=value overrides for every variant")
    ap.add_argument("--json", type=Path, help="write the rows here")
    a = ap.parse_args()
    base = [
        f"model.name={a.model}",
        f"train.steps={a.steps}",
        f"data.seq_len={a.seq_len}",
        f"train.global_batch_size={a.global_batch}",
        "monitor.log_interval=5" if a.steps >= 10 else "monitor.log_interval=1",
        "train.eval_interval=0",
        "monitor.progress=false",
        "data.max_bytes=2000000",
        *a.set,
    ]
    variants = {f"fsdp{a.nproc}": 1, **{f"ep{e}_fsdp{a.nproc}": e for e in map(int, a.ep.split(","))}}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, ep in variants.items():
            row = run(name, [*base, f"parallel.ep={ep}"], a.nproc, Path(tmp))
            row["ep"] = ep
            row["a2a_predicted"] = predicted_a2a_bytes(base, ep) if ep > 1 else 0.0
            rows.append(row)
    ref = rows[0]
    print(f"{a.model} on {a.nproc} ranks, {a.global_batch} x {a.seq_len} tokens per step")
    print("| variant | step ms | x fsdp | peak MiB/rank | x fsdp | a2a MiB/step | predicted | imbalance |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | refused or failed: {r['error']} |")
            continue
        t, m = r["step_time_s"], r["peak_mem_mib"]
        ratio_t = t / ref["step_time_s"] if "step_time_s" in ref else float("nan")
        ratio_m = m / ref["peak_mem_mib"] if ref.get("peak_mem_mib") else float("nan")
        a2a, pred = r["a2a_bytes_per_step"] / 2**20, r["a2a_predicted"] / 2**20
        print(
            f"| {r['name']} | {t * 1e3:.0f} | {ratio_t:.2f} | {m:.0f} | {ratio_m:.2f} | {a2a:.2f} | {pred:.2f} "
            f"| {r['imbalance']:.2f} |"
        )
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
