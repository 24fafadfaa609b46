"""Expert parallelism and tensor parallelism vs FSDP alone on the same mixture-of-experts model and ranks: the real
`scaletrain train` per variant (gloo CPU ranks, fp32, or whatever `--set` asks), median step time over the logging
windows after the first (warm-up), peak memory per rank (the trainer's own peak_mem_bytes_per_rank: the device's
peak on CUDA, the process's peak RSS on CPU), and the all-to-all bytes the dispatchers measured (moe_a2a_bytes:
hidden states sent to other ranks, dispatch + combine, forward, summed over ranks) against the planner's even-routing
figure (plan/experts.py a2a_bytes_per_layer, over every rank, MoE layer and micro-batch). Under TP each TP rank
routes its piece of the tokens, so the all-to-all carries each token once, as without TP.

    python benchmarks/moe.py [--nproc 4] [--ep 2,4] [--tp 2] [--model moe-small] [--steps 20] [--seq-len 256]
                             [--global-batch 16] [--set model.n_experts=32 ...] [--json OUT.json] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ helpers import each other by name

from scaletrain.config import load_config  # noqa: E402
from scaletrain.models.registry import model_spec  # noqa: E402


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
    """The planner's bytes per rank and MoE layer (plan/experts.py) for the step's tokens, over every MoE layer:
    summed over ranks and micro-batches, the step's tokens route once whatever the layout."""
    from scaletrain.plan.experts import a2a_bytes_per_layer

    cfg = load_config(None, overrides)
    args = model_spec(cfg.model).args
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    element = 2 if cfg.precision.dtype in ("bf16", "fp16") else 4
    moe_layers = args.n_layers - args.n_dense_layers
    return a2a_bytes_per_layer(tokens, args.top_k, args.dim, ep, element) * moe_layers


SECTION = "## Mixture of experts: expert and tensor parallelism vs FSDP"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--ep", default="2,4", help="expert-parallel degrees to compare with FSDP alone")
    ap.add_argument("--tp", type=int, default=0, help="also TP of this degree, alone and with the smallest --ep")
    ap.add_argument("--model", default="moe-small")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--set", nargs="*", default=[], help="more key=value overrides for every variant")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--markdown", type=Path, help="write the table into this file's section (BENCHMARKS.md)")
    a = ap.parse_args(argv)
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
    eps = [int(e) for e in a.ep.split(",") if e]
    variants = {f"fsdp{a.nproc}": (1, 1), **{f"ep{e}_fsdp{a.nproc}": (e, 1) for e in eps}}
    if a.tp > 1:
        variants[f"tp{a.tp}_fsdp{a.nproc // a.tp}"] = (1, a.tp)
        if eps:
            variants[f"ep{min(eps)}_tp{a.tp}_fsdp{a.nproc // a.tp}"] = (min(eps), a.tp)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (ep, tp) in variants.items():
            row = run(name, [*base, f"parallel.ep={ep}", f"parallel.tp={tp}"], a.nproc, Path(tmp))
            row |= {"ep": ep, "tp": tp, "a2a_predicted": predicted_a2a_bytes(base, ep) if ep > 1 else 0.0}
            rows.append(row)
    report = table(rows, a)
    print("\n".join(report))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    if a.markdown:
        from peers import machine
        from sections import write_section

        note = (
            "Step time is the median over the logging windows after the first; peak memory the trainer's "
            "peak_mem_bytes_per_rank (the process's peak RSS on CPU); a2a the moe_a2a_bytes metric (forward "
            "dispatch + combine, every rank) against the planner's even-routing bytes (plan/experts.py)."
        )
        write_section(a.markdown, SECTION, "benchmarks/moe.py", argv, report, machine(), note)


def table(rows: list[dict], a) -> list[str]:
    ref = rows[0]
    out = [
        f"{a.model} on {a.nproc} ranks, {a.global_batch} x {a.seq_len} tokens per step",
        "",
        "| variant | step ms | x fsdp | peak MiB/rank | x fsdp | a2a MiB/step | planner MiB/step | imbalance | loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['name']} | refused or failed: {r['error']} | | | | | | | |")
            continue
        t, m = r["step_time_s"], r["peak_mem_mib"]
        ratio_t = t / ref["step_time_s"] if "step_time_s" in ref else float("nan")
        ratio_m = m / ref["peak_mem_mib"] if ref.get("peak_mem_mib") else float("nan")
        a2a, pred = r["a2a_bytes_per_step"] / 2**20, r["a2a_predicted"] / 2**20
        out.append(
            f"| {r['name']} | {t * 1e3:.0f} | {ratio_t:.2f} | {m:.0f} | {ratio_m:.2f} | {a2a:.2f} | {pred:.2f} "
            f"| {r['imbalance']:.2f} | {r['final_loss']:.4f} |"
        )
    return out + [""]


if __name__ == "__main__":
    main()
