"""The planner's predicted step time next to the measured one for every layout benchmarks/layouts.py runs on N
CPU ranks, and where the planner ranks the measured-fastest layout.

    python benchmarks/planner_vs_measured.py [--nproc 4] [--steps 30] [--calibration FILE] [--json OUT.json]
                                             [--from-json OUT.json] [layouts.py flags]

--json keeps the measured rows; --from-json predicts again for rows measured before (no runs).

Without --calibration the planner uses the catalog's CPU placeholders (absolute times are then off; the ranking
is what counts); with a `scaletrain bench` file its compute and all-reduce figures are measured.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from layouts import measured_runs, parse_run_arguments, run_arguments  # noqa: E402  (benchmarks/layouts.py's measurement)

from scaletrain.hardware import apply_calibration, load_calibration, make_cluster  # noqa: E402
from scaletrain.models import preset_spec  # noqa: E402
from scaletrain.plan import Layout, Workload, evaluate_layout  # noqa: E402


def planned_layout(overrides: list[str], global_batch: int) -> Layout:
    """The Layout benchmarks/layouts.py's overrides run (trainer defaults: one micro-batch per DP rank, or one
    sequence per pipeline micro-batch with 1F1B; fp32; no checkpointing)."""
    d = {o.split("=")[0].split(".")[1]: int(o.split("=")[1]) for o in overrides if o.split("=")[1].isdigit()}
    rep, shard, tp, pp = d["dp_replicate"], d["dp_shard"], d["tp"], d["pp"]
    per_rank = global_batch // (rep * shard)
    mb, acc = (1, per_rank) if pp > 1 else (per_rank, 1)
    return Layout(rep, shard, tp, pp, 1, mb, acc, "none", "fp32", "1F1B" if pp > 1 else "none")


def main() -> None:
    ap = run_arguments(__doc__)
    ap.add_argument("--calibration", default="", help="`scaletrain bench` TOML for the planner")
    ap.add_argument("--json", default="", help="also write the measured and predicted rows to this file")
    ap.add_argument("--from-json", default="", help="rows a previous --json wrote: predict again, run nothing")
    a = parse_run_arguments(ap)
    cluster = make_cluster("cpu", a.nproc, gpus_per_node=a.nproc)
    if a.calibration:
        cluster = apply_calibration(cluster, load_calibration(a.calibration))
    work = Workload(a.model, preset_spec(a.model).shape(), a.seq_len, a.global_batch)
    measured = (
        [(r["overrides"].split(), r) for r in json.loads(Path(a.from_json).read_text())]
        if a.from_json
        else measured_runs(a)
    )
    load = os.getloadavg()[0]  # a shared host: the load the runs met is part of the result
    rows = []
    for over, r in measured:
        if "step_time_s" in r:
            r["predicted_s"] = evaluate_layout(work, cluster, planned_layout(over, a.global_batch)).step_s
            rows.append(r)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2) + "\n")
    if not rows:
        sys.exit("no layout ran")
    print(
        f"model {a.model}, {a.nproc} CPU ranks, {a.steps} steps x {a.global_batch} x {a.seq_len} tokens; planner "
        f"on {cluster.gpu.name}"
        + (f" ({cluster.calibration_note})" if cluster.calibration_note else " (catalog placeholders)")
    )
    if not a.from_json:
        print(f"1-minute load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    by_pred = sorted(rows, key=lambda r: r["predicted_s"])
    print(f"{'layout':<14}{'measured ms':>12}{'predicted ms':>13}{'error':>8}{'rank meas.':>11}{'rank pred.':>11}")
    for i, r in enumerate(sorted(rows, key=lambda r: r["step_time_s"]), 1):
        print(
            f"{r['layout']:<14}{r['step_time_s'] * 1e3:>12.1f}{r['predicted_s'] * 1e3:>13.1f}"
            f"{r['predicted_s'] / r['step_time_s'] - 1:>+8.1%}{i:>11}{by_pred.index(r) + 1:>11}"
        )
    errors = [abs(r["predicted_s"] / r["step_time_s"] - 1) for r in rows]
    print(
        f"mean |error| {sum(errors) / len(errors):.1%}, worst {max(errors):.1%}; "
        f"{sum(e <= 0.25 for e in errors)} of {len(rows)} layouts within +-25%"
    )
    fastest = min(rows, key=lambda r: r["step_time_s"])
    print(
        f"measured-fastest {fastest['layout']} is #{by_pred.index(fastest) + 1} of {len(rows)} in the planner's ranking"
    )


if __name__ == "__main__":
    main()
