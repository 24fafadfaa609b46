"""A DLRM on a Criteo-shaped click log (13 dense, 26 categorical columns, generated here with a planted signal and
per-column cardinalities from 4 to --max-cardinality) through `scaletrain data prepare --format tabular` and
`scaletrain train task.name=recommendation`, on --nproc CPU ranks with DDP for the MLPs, the variants alternating
within each rep so drift on a shared machine hits all of them:

1. The tables replicated (parallel.embedding_sharding=none), split row-wise and table-wise (and table-wise with
   train.optimizer_impl=fused, AdamW's one-kernel update, "table+fused"): median step time
   (the first logged step dropped as warm-up), samples per second, the busiest rank's share of the tables'
   weights, gradients and AdamW states (parallel/embedding.py table_elements_per_rank, 16 bytes an element) and the
   peak memory per rank the monitor records (CPU: peak RSS).
2. torchrec's DLRM (torchrec.models.dlrm.DLRM: EmbeddingBagCollection tables sharded table-wise by
   DistributedModelParallel, its fused CPU kernel with row-wise Adagrad for the tables (fbgemm has no Adam on CPU), the dense part under DDP with AdamW)
   on the same arrays, shapes, batches and ranks: median step time against scaletrain's table-wise. Needs
   `--torchrec DIR`: a folder torchrec 1.8.0 and fbgemm-gpu-cpu 1.8.0 were installed into with `pip install
   --no-deps --target DIR torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0 tensordict torchmetrics==1.0.3 pyre-extensions
   typing-inspect` (the newest torchrec, 1.9.2, does not load beside torch 2.13; see docs/recommendation.md);
   skipped with the reason otherwise.

    python benchmarks/recommender.py [--nproc 2] [--rows 200000] [--dim 16] [--batch 512] [--steps 30] [--reps 2]
                                     [--torchrec DIR] [--markdown BENCHMARKS.md]
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

N_DENSE, N_SPARSE = 13, 26
BOTTOM, TOP = (64, 32), (64, 32)
FOOTER = (
    "Step times come from CPU cores shared with other jobs: read the ratios, not the seconds. The tables are "
    "updated by a dense AdamW in scaletrain (every row each step) and by fbgemm's fused row-wise Adagrad (its CPU kernel has no Adam) on the rows a batch "
    "touched in torchrec, so the torchrec row is the reference implementation's speed, not the same arithmetic. "
    "torchrec's step is timed around its forward, backward and optimizer steps (a barrier before and after); "
    "scaletrain's is the trainer's whole step (its data, forward, backward, optimizer and metrics). On CPU ranks "
    "the monitor's peak memory is the process's peak RSS over its whole life (interpreter and torch included)."
)


def _click_log(work: Path, rows: int, max_card: int, seed: int = 0) -> Path:
    """A Parquet click log with Criteo's column layout whose click rate depends on three columns."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    cards = np.unique(np.geomspace(4, max_card, N_SPARSE).astype(int))
    cards = np.resize(cards, N_SPARSE)
    dense = rng.exponential(3.0, (rows, N_DENSE)).astype(np.float32)
    cats = (rng.random((rows, N_SPARSE)) ** 2 * cards).astype(np.int64)  # skewed: low ids are frequent
    effect = rng.normal(0, 1.0, int(cards[0]) + 1)
    logit = effect[cats[:, 0]] + 0.4 * (np.log1p(dense[:, 0]) - 1.2) + 0.6 * (cats[:, 3] % 7 == 0) - 1.0
    label = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    columns = {"label": label, **{f"I{i + 1}": dense[:, i] for i in range(N_DENSE)}}
    columns.update({f"C{i + 1}": cats[:, i] for i in range(N_SPARSE)})
    path = work / "clicks.parquet"
    pq.write_table(pa.table(columns), path)
    return path


def _prepare(work: Path, source: Path) -> Path:
    out = work / "data"
    dense = ",".join(f"I{i + 1}" for i in range(N_DENSE))
    sparse = ",".join(f"C{i + 1}" for i in range(N_SPARSE))
    cmd = [sys.executable, "-m", "scaletrain.cli.main", "data", "prepare", str(source), "--out", str(out),
           "--format", "tabular", "--dense-cols", dense, "--sparse-cols", sparse, "--val-share", "0.01"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=work)
    return out


def _model_args(a) -> list[str]:
    return [f"model.embedding_dim={a.dim}", f"model.bottom_mlp={list(BOTTOM)}", f"model.top_mlp={list(TOP)}"]


def _train(a, work: Path, data: Path, name: str, variant: str) -> list[dict]:
    """One `scaletrain train` run; its metrics records with a step time (the first dropped as warm-up)."""
    cmd = [sys.executable, "-m", "scaletrain.cli.main", "train", "task.name=recommendation", "model.name=dlrm-small",
           f"data.path={data}", *_model_args(a), f"train.global_batch_size={a.batch}", f"train.steps={a.steps}",
           "train.lr=0.001", "train.warmup_steps=0", "train.grad_clip=0", "train.eval_interval=0",
           "monitor.log_interval=1", "monitor.progress=false", "monitor.sample_interval_s=0",
           "monitor.tensorboard=false", "checkpoint.save_final=false", f"run.name={name}", f"run.output_dir={work}",
           f"parallel.dp_replicate={a.nproc}", "parallel.dp_shard=1",
           f"parallel.embedding_sharding={variant.split('+')[0]}",
           f"train.optimizer_impl={'fused' if variant.endswith('+fused') else 'foreach'}",
           "--nproc-per-node", str(a.nproc)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=work)
    rows = [json.loads(x) for x in (work / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "step_time_s" in r][1:]


def _table_rows(data: Path) -> list[int]:
    """Each table's rows as the trainer sizes them (the data's distinct ids, at most dlrm-small's max_rows)."""
    from scaletrain.config import load_config
    from scaletrain.resolve.job import resolve_job

    cfg = load_config(None, ["task.name=recommendation", "model.name=dlrm-small", f"data.path={data}",
                             "train.global_batch_size=8"])  # fmt: skip
    return list(resolve_job(cfg, 1).spec.rows)


def _torchrec_missing(folder: Path | None) -> str | None:
    if folder is None:
        return "not run: give --torchrec DIR (a folder torchrec 1.8.0 + fbgemm-gpu-cpu 1.8.0 were installed into)"
    probe = [sys.executable, "-c", "import torchrec, fbgemm_gpu"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(probe, capture_output=True, text=True, env=env)
    return None if done.returncode == 0 else f"not run: torchrec does not import ({done.stderr.strip()[-200:]})"


def _torchrec_worker(job: dict) -> None:
    """One rank of torchrec's DLRM (torchrun runs it): the same arrays, batches and shapes as scaletrain's run."""
    import time

    import numpy as np
    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.models.dlrm import DLRM

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    rows, dim = job["rows"], job["dim"]
    names = [f"C{i + 1}" for i in range(N_SPARSE)]
    tables = [EmbeddingBagConfig(name=f"t_{n}", embedding_dim=dim, num_embeddings=r, feature_names=[n])
              for n, r in zip(names, rows, strict=True)]  # fmt: skip
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRM(ebc, N_DENSE, [*BOTTOM, dim], [*TOP, 1], dense_device=torch.device("cpu"))
    constraints = {f"t_{n}": ParameterConstraints(sharding_types=["table_wise"]) for n in names}
    sharders = [
        EmbeddingBagCollectionSharder(
            fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 1e-3}
        )
    ]
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"),
                                       constraints=constraints)  # fmt: skip
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    dense_params = [p for n, p in dmp.named_parameters() if "embedding_bags" not in n]
    optim = torch.optim.AdamW(dense_params, lr=1e-3)
    data = Path(job["data"]) / "train"
    dense_all = np.load(data / "dense.npy", mmap_mode="r")
    sparse_all = np.load(data / "sparse.npy", mmap_mode="r")
    labels_all = np.load(data / "labels.npy", mmap_mode="r")
    per_rank = job["batch"] // world
    modulo = torch.tensor(rows)
    times = []
    for step in range(job["steps"]):
        start = (step * job["batch"] + rank * per_rank) % (len(labels_all) - per_rank)
        dense = torch.from_numpy(np.array(dense_all[start : start + per_rank]))
        ids = torch.from_numpy(np.array(sparse_all[start : start + per_rank])) % modulo
        labels = torch.from_numpy(np.array(labels_all[start : start + per_rank]))
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=names, values=ids.t().reshape(-1),
                                                  lengths=torch.ones(per_rank * N_SPARSE, dtype=torch.int64))  # fmt: skip
        dist.barrier()
        began = time.perf_counter()
        logits = dmp(dense_features=dense, sparse_features=kjt).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        optim.zero_grad()
        loss.backward()
        optim.step()
        dist.barrier()
        times.append(time.perf_counter() - began)
    if rank == 0:
        Path(job["out"]).write_text(json.dumps({"step_times": times[1:]}))
    dist.destroy_process_group()


def _torchrec(a, work: Path, data: Path, rows: list[int], name: str) -> dict:
    out = work / f"{name}.json"
    job = {"rows": rows, "dim": a.dim, "data": str(data), "batch": a.batch, "steps": a.steps, "out": str(out)}
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(a.torchrec), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.nproc), "--master-port", "29531",
           __file__, "--torchrec-worker", json.dumps(job)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work, timeout=1800)
    if done.returncode != 0:
        errors = [x for x in done.stderr.splitlines() if "Error" in x]
        return {"failed": (errors[-1] if errors else done.stderr.strip()[-200:] or "no output")[:300]}
    return json.loads(out.read_text())


def _median_step(rows: list[dict]) -> float:
    return statistics.median(r["step_time_s"] for r in rows)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rows", type=int, default=200_000, help="click-log rows generated")
    ap.add_argument("--max-cardinality", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=512, help="global batch (samples per step)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--torchrec", type=Path, default=None, help="folder torchrec was installed into (--target)")
    ap.add_argument("--markdown", type=Path, default=None)
    ap.add_argument("--torchrec-worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.torchrec_worker:
        _torchrec_worker(json.loads(a.torchrec_worker))
        return ""
    from scaletrain.config.table_sharding import table_elements_per_rank

    skip = _torchrec_missing(a.torchrec)
    variants = ("none", "row", "table", "table+fused")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    torchrec_times: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = _prepare(work, _click_log(work, a.rows, a.max_cardinality))
        rows = _table_rows(data)
        for rep in range(a.reps):
            for v in variants:
                runs[v] += _train(a, work, data, f"{v.replace('+', '_')}{rep}", v)
            if skip is None:
                got = _torchrec(a, work, data, rows, f"torchrec{rep}")
                if "failed" in got:
                    skip = f"failed: {got['failed']}"
                else:
                    torchrec_times += got["step_times"]
    lines = [
        f"**Tables replicated, row-wise and table-wise** ({a.nproc} CPU ranks, DDP for the MLPs, {N_DENSE} dense + "
        f"{N_SPARSE} categorical columns, {sum(rows):,} table rows of {a.dim}, global batch {a.batch}, {a.steps} "
        f"steps x {a.reps} reps).",
        "",
        "| tables | median step (ms) | samples/s | step ÷ replicated | table states/rank (MB) | peak memory/rank (GB) |",
        "|---|---|---|---|---|---|",
    ]
    base = _median_step(runs["none"])
    for v in variants:
        step = _median_step(runs[v])
        states = 16 * table_elements_per_rank(rows, a.dim, v.split("+")[0], a.nproc) / 1e6
        peak = max(max(r["peak_mem_bytes_per_rank"]) for r in runs[v]) / 1e9
        lines.append(f"| {v} | {step * 1e3:.1f} | {a.batch / step:,.0f} | {step / base:.2f} | {states:.1f} | "
                     f"{peak:.2f} |")  # fmt: skip
    lines += ["", "**scaletrain against torchrec's DLRM** (table-wise, same arrays, shapes, batches and ranks).", ""]
    if skip is not None:
        lines.append(f"torchrec: {skip}.")
    else:
        theirs = statistics.median(torchrec_times)
        ours, fused = _median_step(runs["table"]), _median_step(runs["table+fused"])
        lines += [
            "| trainer | median step (ms) | scaletrain ÷ torchrec |",
            "|---|---|---|",
            f"| scaletrain (table-wise, foreach AdamW) | {ours * 1e3:.1f} | {ours / theirs:.2f} |",
            f"| scaletrain (table-wise, fused AdamW: train.optimizer_impl=fused) | {fused * 1e3:.1f} | "
            f"{fused / theirs:.2f} |",
            f"| torchrec 1.8.0 DMP (table_wise, fused row-wise Adagrad) | {theirs * 1e3:.1f} | 1.00 |",
        ]
    report = "\n".join(lines)
    print(report)
    if a.markdown is not None:
        sys.path.insert(0, str(Path(__file__).parent))
        import sections as section_writer
        from peers import machine

        section_writer.write_section(a.markdown, "## Recommenders: sharded embedding tables, against torchrec",
                                     "benchmarks/recommender.py", argv, [*lines, ""], machine(), footer=FOOTER)  # fmt: skip
    return report


if __name__ == "__main__":
    main()
