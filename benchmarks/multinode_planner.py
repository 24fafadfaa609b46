"""The planner on simulated nodes: 2 nodes x 2 CPU ranks (network namespaces, tests/cluster/cluster_nodes.py), the
link between them shaped with `tc tbf` to each rate in turn. At every rate: `scaletrain bench --nodes 2` on the
shaped link writes a calibration, then DDP, FSDP and HSDP (shard inside a node, replicate across) train the same
job across both nodes (`scaletrain train --nnodes 2`), and the measured median step time stands next to the
planner's prediction (`scaletrain plan JOB --gpus 4 --gpus-per-node 2 --gpu cpu --calibration CAL`) and both
rankings. Root only (network namespaces); nothing is left behind.

    sudo python benchmarks/multinode_planner.py [--rates 1gbit,4gbit] [--steps 25] [--log-every 5] [--repeats 3]
                                                [--model small] [--json OUT.json] [--set key=value ...]

Step times are measured as benchmarks/layouts.py measures them: the median over logging windows after the first
(each window's mean step; the loss report's all-reduce and the metrics' collectives fall once per window, as in a
run that logs every few steps, not on every step as with log_interval=1).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "cluster"))
from cluster_nodes import Cluster, unavailable  # noqa: E402

ENDPOINT = "198.51.100.1:29400"
LAYOUTS = {
    "ddp": ["parallel.dp_replicate=4", "parallel.dp_shard=1"],
    "fsdp": ["parallel.dp_replicate=1", "parallel.dp_shard=4"],
    "hsdp": ["parallel.dp_replicate=2", "parallel.dp_shard=2"],  # shard inside a node, replicate across
}


def job(args) -> list[str]:
    """The job every layout trains: every planner-pinned field set, so `scaletrain plan` evaluates exactly it."""
    return [
        f"model.name={args.model}",
        f"data.seq_len={args.seq_len}",
        f"train.global_batch_size={args.global_batch}",
        f"train.micro_batch_size={args.global_batch // 4}",
        "precision.dtype=fp32",
        "parallel.tp=1",
        "parallel.pp=1",
        "parallel.activation_checkpoint=none",
        *args.set,
    ]


def on_nodes(cluster: Cluster, argv: list[list[str]], cwd: Path, timeout: float = 900) -> list[str]:
    """Run `scaletrain ARGS` in every node at once (argv[node index] -> ARGS); their stdout, or exit on failure."""
    procs = [
        node.popen(
            [sys.executable, "-m", "scaletrain.cli.main", *argv[node.index]],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in cluster.nodes
    ]
    outs = []
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            sys.exit(f"node {i}: `scaletrain {' '.join(argv[i])}` exited {p.returncode}: {err[-2000:]}")
        outs.append(out)
    return outs


def measured_step(run: Path) -> float:
    """Median step time of a run, seconds, over its logging windows after the first (warm-up)."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r][1:]
    return statistics.median(times)


def predicted_step(job_args: list[str], layout: list[str], cal: Path, cwd: Path) -> float:
    """The planner's step time for this layout on 2 nodes x 2 ranks with the calibration, seconds."""
    cmd = [sys.executable, "-m", "scaletrain.cli.main", "plan", *job_args, *layout]
    cmd += ["--gpus", "4", "--gpus-per-node", "2", "--gpu", "cpu", "--calibration", str(cal), "--json"]
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=True, timeout=300).stdout
    return float(json.loads(out)["layouts"][0]["time_s"]["step"])


def ranks(values: dict[str, float]) -> dict[str, int]:
    order = sorted(values, key=values.__getitem__)
    return {name: order.index(name) + 1 for name in values}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="1gbit,4gbit", help="tc tbf rates of the inter-node link, comma-separated")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--log-every", type=int, default=5, help="steps per logging window")
    ap.add_argument("--repeats", type=int, default=3, help="rounds over every rate; medians are reported")
    ap.add_argument("--model", default="small")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--size-mb", type=float, default=16.0, help="largest message `bench --nodes` measures")
    ap.add_argument("--json", default=None)
    ap.add_argument("--set", nargs="*", default=[], help="more job overrides (key=value)")
    args = ap.parse_args()
    if args.steps < 2 * args.log_every:
        sys.exit(
            f"multinode_planner: --steps {args.steps} gives no window after the first; use >= {2 * args.log_every}"
        )
    why = unavailable()
    if why:
        sys.exit(f"multinode_planner: {why}")
    job_args = job(args)
    train_args = [
        *job_args,
        f"train.steps={args.steps}",
        f"monitor.log_interval={args.log_every}",
        "monitor.progress=false",
        "train.eval_interval=0",
        "train.warmup_steps=2",
        "data.max_bytes=300000",
        "checkpoint.save_final=false",
        "checkpoint.interval_steps=0",
    ]
    rates = args.rates.split(",")
    # round after round, every rate's bench and its three runs back to back: load on a shared host coming and going
    # falls on each calibration and the runs it predicts alike, and the medians over rounds are what is reported
    measured: dict[tuple[str, str], list[float]] = {(r, n): [] for r in rates for n in LAYOUTS}
    predicted: dict[tuple[str, str], list[float]] = {(r, n): [] for r in rates for n in LAYOUTS}
    loads = [f"before: {uptime()}"]
    with tempfile.TemporaryDirectory(prefix="multinode_planner_") as tmp, Cluster.create(2) as cluster:
        cwd = Path(tmp)
        for rnd in range(args.repeats):
            for rate in rates:
                cluster.shape(rate)
                cal = cwd / f"cal_{rate}_{rnd}.toml"
                bench = on_nodes(
                    cluster,
                    [
                        ["bench", "--nodes", "2", "--node-rank", str(i), "--rdzv-endpoint", ENDPOINT]
                        + ["--nproc", "2", "--size-mb", str(args.size_mb), "-o", str(cal)]
                        for i in range(2)
                    ],
                    cwd,
                )
                print(f"round {rnd + 1}, {rate}: {bench[0].strip()}", flush=True)
                for name, layout in LAYOUTS.items():
                    run = f"{name}_{rate}_{rnd}"
                    on_nodes(
                        cluster,
                        [
                            ["train", *train_args, *layout, f"run.name={run}", "--nproc-per-node", "2"]
                            + ["--nnodes", "2", "--node-rank", str(i), "--rdzv-endpoint", ENDPOINT]
                            for i in range(2)
                        ],
                        cwd,
                    )
                    measured[rate, name].append(measured_step(cwd / "runs" / run))
                    predicted[rate, name].append(predicted_step(job_args, layout, cal, cwd))
                    print(
                        f"  {name}: measured {measured[rate, name][-1]:.3f} s, "
                        f"predicted {predicted[rate, name][-1]:.3f} s",
                        flush=True,
                    )
                loads.append(f"after round {rnd + 1}, {rate}: {uptime()}")
    rows = []
    for rate in rates:
        meas = {n: statistics.median(measured[rate, n]) for n in LAYOUTS}
        pred = {n: statistics.median(predicted[rate, n]) for n in LAYOUTS}
        rank_m, rank_p = ranks(meas), ranks(pred)
        for name in LAYOUTS:
            rows.append(
                {
                    "layout": name,
                    "rate": rate,
                    "measured_s": meas[name],
                    "predicted_s": pred[name],
                    "error": pred[name] / meas[name] - 1.0,
                    "rank_measured": rank_m[name],
                    "rank_predicted": rank_p[name],
                    "measured_rounds": measured[rate, name],
                    "predicted_rounds": predicted[rate, name],
                }
            )
    print(
        f"\n2 nodes x 2 CPU ranks, model {args.model}, seq {args.seq_len}, global batch {args.global_batch}, "
        f"fp32, {args.steps} steps (median of the {args.log_every}-step windows after the first), median of "
        f"{args.repeats} rounds; {os.cpu_count()} cores"
    )
    print(
        f"{'layout':<8}{'link':>8}{'measured s':>12}{'predicted s':>13}{'error':>8}{'rank meas':>11}{'rank pred':>11}"
    )
    for r in rows:
        print(
            f"{r['layout']:<8}{r['rate']:>8}{r['measured_s']:>12.3f}{r['predicted_s']:>13.3f}{r['error']:>+8.0%}"
            f"{r['rank_measured']:>11}{r['rank_predicted']:>11}"
        )
    for rate in rates:
        at = [r for r in rows if r["rate"] == rate]
        top_m = min(at, key=lambda r: r["measured_s"])["layout"]
        top_p = min(at, key=lambda r: r["predicted_s"])["layout"]
        worst = max(abs(r["error"]) for r in at)
        print(f"{rate}: measured fastest {top_m}, planner's top pick {top_p}; worst |error| {worst:.0%}")
    print("\n".join(loads))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "load": loads, "args": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
