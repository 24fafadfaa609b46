"""Recommenders through the same path as language models: a click log prepared with `data prepare --format tabular`,
the recommendation task on the built-in DLRM, its embedding tables sharded over the ranks row-wise and table-wise
beside DDP or FSDP2 for the MLPs: per-step losses and final weights equal to one unsharded process, AUC above chance
on a click log with a planted signal, a SIGKILLed run resuming bit-identical, a checkpoint resharded to another
sharding and rank count, and the tables exported as safetensors. The click log is generated here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli_in_process

TOL = 1e-5
DENSE, SPARSE = ["d0", "d1", "d2", "d3"], ["c0", "c1", "c2", "c3", "c4"]


def make_clicks(path: Path, n: int = 3000, seed: int = 0) -> Path:
    """A Parquet click log whose click rate is set by column c0's category, d0 and c2 == v3 (a signal to learn)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    dense = rng.exponential(3.0, (n, len(DENSE)))
    cats = rng.integers(0, [50, 20, 8, 100, 5], (n, len(SPARSE)))
    effect = rng.normal(0, 1.5, 50)
    logit = effect[cats[:, 0]] + 0.5 * (np.log1p(dense[:, 0]) - 1.2) + 0.8 * (cats[:, 2] == 3)
    label = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    columns = {"label": label, **{c: dense[:, i] for i, c in enumerate(DENSE)}}
    columns.update({c: [f"v{v}" for v in cats[:, i]] for i, c in enumerate(SPARSE)})
    pq.write_table(pa.table(columns), path)
    return path


@pytest.fixture(scope="module")
def clicks(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("clicks")
    out = tmp / "data"
    args = ["data", "prepare", str(make_clicks(tmp / "clicks.parquet")), "--out", str(out), "--format", "tabular",
            "--dense-cols", ",".join(DENSE), "--sparse-cols", ",".join(SPARSE), "--val-share", "0.2"]  # fmt: skip
    run_cli_in_process(args, tmp)
    return out


def _resolve(overrides: list[str]):
    from scaletrain.config import load_config
    from scaletrain.resolve.job import resolve_job

    return resolve_job(load_config(None, overrides), 1)


def test_binned_auc_equals_the_exact_auc():
    import torch

    from scaletrain.tasks.recommendation import AUC_BINS, Recommendation, binned_auc

    gen = torch.Generator().manual_seed(0)
    labels = (torch.rand(4000, generator=gen) < 0.3).float()
    logits = torch.randn(4000, generator=gen) + 1.5 * labels  # positives score higher
    task = Recommendation()
    sums = task.eval_sums(logits, labels)
    hist = sums["auc_hist"].tolist()
    got = binned_auc(hist[:AUC_BINS], hist[AUC_BINS:])
    pos, neg = logits[labels > 0.5], logits[labels < 0.5]
    exact = (pos[:, None] > neg[None, :]).double().mean() + 0.5 * (pos[:, None] == neg[None, :]).double().mean()
    assert abs(got - exact.item()) < 2e-3 and 0.8 < got < 0.9
    metrics = task.eval_metrics(2000.0, 4000.0, {"auc_hist": hist, "positives": float(sums["positives"])})
    assert metrics["val_loss"] == 0.5 and metrics["val_auc"] == got and 0.5 < metrics["val_ne"] < 1.0


def test_table_wise_sharding_balances_rows_largest_first():
    from scaletrain.config.table_sharding import assign_tables, row_range

    assert assign_tables([10, 1000, 30, 500, 600], 2) == [0, 0, 0, 1, 1]  # 1000 + 30 + 10 | 600 + 500
    assert assign_tables([5, 5, 5], 4) == [0, 1, 2]
    assert [row_range(7, 3, r) for r in range(3)] == [(0, 3), (3, 6), (6, 7)]  # torch.chunk's cut (DTensor's)
    assert row_range(2, 3, 2) == (2, 2)  # a rank may hold none of a small table


def test_the_task_sizes_the_tables_from_the_data_and_refuses_bad_input(clicks):
    job = ["task.name=recommendation", f"data.path={clicks}", "train.global_batch_size=8"]
    spec = _resolve([*job, "model.name=dlrm-tiny"]).spec
    manifest = json.loads((clicks / "manifest.json").read_text())
    distinct = [manifest["sparse_ids"][c]["distinct"] for c in SPARSE]
    assert spec.family == "dlrm" and spec.args.n_dense == 4 and spec.args.sparse_columns == tuple(SPARSE)
    assert list(spec.args.table_rows) == distinct == [50, 20, 8, 100, 5]
    capped = _resolve([*job, "model.name=dlrm-tiny", "model.max_rows=30"]).spec
    assert list(capped.args.table_rows) == [30, 20, 8, 30, 5]
    bad = {
        "model.name=tiny": "task.name: recommendation feeds dense and categorical features, and the llama model is "
        "not a recommender; use model.name=dlrm-tiny (or another dlrm preset)",
        "model.name=dlrm-tiny model.table_rows=[10,10]": "model.table_rows: 2 tables given for the data's 5 "
        "categorical columns; give one per column or leave it unset",
        "model.name=dlrm-tiny model.n_dense=3": "model.n_dense: the data has 4 dense features, the model 3; leave "
        "model.n_dense unset to take the data's",
        "model.name=dlrm-tiny parallel.tp=2": "parallel.tp: recommendation does not run under this parallelism yet; "
        "use parallel.tp=1",
        "model.name=dlrm-tiny model.embedding_dim=x": "model.embedding_dim: input should be a valid integer (got 'x')",
    }
    for overrides, message in bad.items():
        with pytest.raises(ValueError) as e:
            _resolve([*job, *overrides.split()])
        assert str(e.value) == message


def test_bad_recommender_input_is_one_line_exit_2(tmp_path, clicks):
    from click.testing import CliRunner

    from scaletrain.cli.main import main

    cases = {
        ("task.name=recommendation", "model.name=dlrm-tiny", "data.path=/no/such/folder"): "data.path",
        ("task.name=recommendation", "model.name=dlrm-tiny", f"data.path={clicks}",
         "parallel.embedding_sharding=columns"): "parallel.embedding_sharding",
    }  # fmt: skip
    for args, field in cases.items():
        result = CliRunner().invoke(main, ["train", *args])
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"scaletrain: error: {field}"), result.stderr


JOB = ["task.name=recommendation", "model.name=dlrm-tiny", "train.global_batch_size=32", "train.lr=0.01",
       "train.steps=5"]  # fmt: skip


@pytest.fixture(scope="module")
def layouts(clicks, tmp_path_factory):
    """One process (unsharded tables) and, in one 2-rank launch, the tables row-wise and table-wise beside DDP (with
    accumulation) and FSDP2: 5 steps each; the one-process launch also trains to its validation AUC."""
    from test_parallel_layouts import launch_runner

    out = tmp_path_factory.mktemp("layouts")
    base = [*JOB, f"data.path={clicks}"]
    fit = [*base, "train.steps=60", "train.warmup_steps=3", "train.eval_interval=60", "train.eval_batches=6",
           "train.global_batch_size=64", f"run.output_dir={out}", "run.name=fit", "monitor.log_interval=10"]  # fmt: skip
    launch_runner(1, {"single": [*base, "parallel.dp_shard=1"], "fit": [*fit, "parallel.dp_shard=1"]}, out,
                  fit=frozenset({"fit"}))  # fmt: skip
    ddp = ["parallel.dp_replicate=2", "parallel.dp_shard=1"]
    launch_runner(2, {
        "ddp2_row_accumulate": [*base, *ddp, "parallel.embedding_sharding=row", "train.micro_batch_size=8"],
        "ddp2_table": [*base, *ddp, "parallel.embedding_sharding=table"],
        "fsdp2_row": [*base, "parallel.dp_shard=2", "parallel.embedding_sharding=row"],
        "fsdp2_table": [*base, "parallel.dp_shard=2", "parallel.embedding_sharding=table"],
        "fsdp2_row_fused": [*base, "parallel.dp_shard=2", "parallel.embedding_sharding=row",
                            "train.optimizer_impl=fused"],
    }, out)  # fmt: skip
    return out


@pytest.mark.slow  # two launches (one process, two ranks)
def test_sharded_tables_equal_one_unsharded_process(layouts):
    import torch
    from test_parallel_layouts import runner_losses, runner_state

    ref, want = runner_losses(layouts / "single"), runner_state(layouts / "single")
    assert len(ref) == 5 and any(k.startswith("embeddings.tables.c0") for k in want)
    # fused AdamW (one kernel for the update) against the one-process foreach reference: the same arithmetic
    for name in ("ddp2_row_accumulate", "ddp2_table", "fsdp2_row", "fsdp2_table", "fsdp2_row_fused"):
        got = runner_losses(layouts / name)
        for step, (a, b) in enumerate(zip(ref, got, strict=True), 1):
            assert abs(a - b) <= TOL, f"{name} step {step}: {b} vs one process {a}"
        state = runner_state(layouts / name)
        assert state.keys() == want.keys(), name
        for key, value in want.items():
            assert torch.allclose(state[key], value, atol=TOL), f"{name}: {key}"


@pytest.mark.slow  # shares the launches above
def test_training_learns_the_planted_clicks(layouts):
    from scaletrain.monitor import read_jsonl

    records = read_jsonl(layouts / "fit/metrics.jsonl")
    evaluated = [r for r in records if "val_auc" in r]
    assert evaluated and evaluated[-1]["val_auc"] > 0.65, records[-3:]  # chance: 0.5
    assert evaluated[-1]["val_ne"] < 1.0  # better than predicting the base rate
    assert all("samples_per_s" in r for r in records if "loss" in r)


RESUME_STEPS = 24  # checkpoints every 4: a kill after step 9 resumes from 8 or later
RESUME_JOB = [*JOB, f"train.steps={RESUME_STEPS}", "train.eval_interval=0", "train.eval_batches=1",
              "monitor.log_interval=1", "monitor.progress=false", "checkpoint.interval_steps=4",
              "checkpoint.save_final=true", "checkpoint.keep=0", "parallel.embedding_sharding=table"]  # fmt: skip


@pytest.fixture(scope="module")
def clean_run(clicks, tmp_path_factory):
    from conftest import run_cli

    cwd = tmp_path_factory.mktemp("resume")
    run_cli(["train", *RESUME_JOB, f"data.path={clicks}", "run.name=clean", "--nproc-per-node", "2"], cwd)
    return cwd


def _final_state(run: Path, step: int = RESUME_STEPS) -> dict:
    from scaletrain.checkpoint.export import load_full_model_state

    return load_full_model_state(run / "checkpoints" / f"step_{step:08d}")[0]


@pytest.mark.slow  # a 2-rank launch killed and restarted, plus the clean reference
def test_sigkill_mid_run_resumes_bit_identical_with_the_data_position(clean_run, clicks):
    import os
    import signal

    import torch
    from test_checkpoint import _start, _wait_for_step, _workers

    from conftest import losses

    args = ["train", *RESUME_JOB, f"data.path={clicks}", "run.name=killed", "launch.max_restarts=2",
            "--nproc-per-node", "2"]  # fmt: skip
    proc = _start(args, clean_run)
    reached = _wait_for_step(clean_run / "runs/killed", 9, proc)
    os.kill(_workers(clean_run / "runs/killed")[-1], signal.SIGKILL)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "resumed from" in err, err[-3000:]
    assert reached < RESUME_STEPS
    got, want = _final_state(clean_run / "runs/killed"), _final_state(clean_run / "runs/clean")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert losses(clean_run / "runs/killed") == losses(clean_run / "runs/clean")


@pytest.mark.slow  # shares the clean run above
def test_the_tables_all_to_all_bytes_are_logged(clean_run):
    """Table-wise on 2 ranks, 16 samples a rank: each rank sends the other its tables' rows for the other's 16
    samples, 8 fp32 wide: 16 x 5 tables x 8 x 4 bytes a step over both ranks, forward."""
    from scaletrain.monitor import read_jsonl

    logged = [r["table_a2a_bytes"] for r in read_jsonl(clean_run / "runs/clean/metrics.jsonl") if "loss" in r]
    assert len(logged) == RESUME_STEPS and set(logged) == {16 * 5 * 8 * 4}


@pytest.mark.slow  # shares the clean run above
def test_a_table_wise_checkpoint_resumes_row_wise_and_in_one_process(clean_run, clicks):
    """The 2-rank table-wise run's step-12 checkpoint continues under row-wise sharding on 2 ranks and unsharded in
    one process, each with the clean run's losses of steps 13-24 (DCP reshards the tables)."""
    import shutil

    from conftest import losses, run_cli

    clean = clean_run / "runs/clean"
    want = losses(clean)[12:]
    for name, layout in (("row2", ["parallel.embedding_sharding=row", "--nproc-per-node", "2"]),
                         ("single", ["parallel.dp_shard=1", "--nproc-per-node", "1"])):  # fmt: skip
        run = clean_run / "runs" / f"from12_{name}"
        (run / "checkpoints").mkdir(parents=True)
        shutil.copytree(clean / "checkpoints/step_00000012", run / "checkpoints/step_00000012")
        args = ["train", *RESUME_JOB, f"data.path={clicks}", f"run.name=from12_{name}",
                *layout]  # fmt: skip
        run_cli([a for a in args if a != "parallel.embedding_sharding=table"], clean_run)
        got = losses(run)[-len(want) :]
        assert len(got) == len(want) and all(abs(a - b) <= TOL for a, b in zip(got, want, strict=True)), name


@pytest.mark.slow  # shares the clean run above
def test_tables_export_as_safetensors_named_by_column(clean_run, tmp_path):
    import torch
    from safetensors.torch import load_file

    ckpt = clean_run / "runs/clean/checkpoints" / f"step_{RESUME_STEPS:08d}"
    run_cli_in_process(["ckpt", "export", str(ckpt), "--format", "safetensors", "--out", str(tmp_path / "st")],
                       clean_run)  # fmt: skip
    exported: dict[str, torch.Tensor] = {}
    for f in sorted((tmp_path / "st").glob("*.safetensors")):
        exported.update(load_file(str(f)))
    state = _final_state(clean_run / "runs/clean")
    assert exported.keys() == state.keys()
    assert {k for k in exported if k.startswith("embeddings.")} == {f"embeddings.tables.{c}.weight" for c in SPARSE}
    assert exported["embeddings.tables.c3.weight"].shape == (100, 8)
    assert all(torch.equal(exported[k], state[k]) for k in state)


def test_tables_larger_than_a_rank_are_refused_before_launch(clicks, monkeypatch):
    """The busiest rank's table states (16 bytes an element) against its memory: 8 GB of RAM over 2 CPU ranks."""
    import scaletrain.resolve.checks as checks
    from scaletrain.config.table_sharding import table_elements_per_rank

    monkeypatch.setattr(checks, "host_memory_bytes", lambda: 8e9)
    assert table_elements_per_rank([100, 50, 7], 4, "row", 2) == (50 + 25 + 4) * 4
    assert table_elements_per_rank([100, 50, 7], 4, "table", 2) == 100 * 4  # 100 | 50 + 7
    assert table_elements_per_rank([100, 50, 7], 4, "none", 2) == 157 * 4
    job = ["task.name=recommendation", "model.name=dlrm-tiny", f"data.path={clicks}", "train.global_batch_size=8",
           "model.embedding_dim=1024", "model.table_rows=[100000,50000,100000,100000,100000]", "run.device=cpu"]  # fmt: skip
    from scaletrain.config import load_config
    from scaletrain.resolve.job import resolve_job

    resolve_job(load_config(None, [*job, "parallel.embedding_sharding=row"]), 2)  # 3.7 GB of 4 on the busiest
    with pytest.raises(ValueError) as e:
        resolve_job(load_config(None, [*job, "parallel.embedding_sharding=table"]), 2)
    assert str(e.value) == (
        "parallel.embedding_sharding: the embedding tables need 4.1 GB on the busiest rank (weights, gradients and "
        "AdamW states, table sharding over 2 rank(s)), more than a CPU rank's share of the host's RAM (4.0 GB); use "
        "more ranks, embedding_sharding=row, or a lower model.max_rows"
    )


def test_plan_of_a_recommender_job_shards_its_tables(clicks, tmp_path):
    """`scaletrain plan CONFIG` sizes the tables from the job's data and holds each rank's share of them (the
    busiest rank's, as the trainer shards them) beside the MLPs' DDP or FSDP2 share; a preset without columns is
    refused in one line."""
    import math

    from scaletrain.config.table_sharding import table_elements_per_rank

    job = ["task.name=recommendation", "model.name=dlrm-tiny", f"data.path={clicks}"]
    out = run_cli_in_process(["plan", *job, "parallel.embedding_sharding=table", "--gpus", "2", "--json"], tmp_path)
    plan = json.loads(out.stdout)
    spec = _resolve([*job, "train.global_batch_size=8"]).spec
    model = spec.build("meta")
    mlp = [p.shape for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    held = table_elements_per_rank(spec.rows, 8, "table", 2)
    assert held == max(50 * 8, (20 + 8 + 5) * 8, 100 * 8) == 800  # c3's 100 rows alone on one rank
    assert {r["layout"]["dp_shard"] for r in plan["rows"]} == {1, 2}
    for row in plan["rows"]:
        fsdp = row["layout"]["dp_shard"] == 2
        local = sum(-(-s[0] // 2) * math.prod(s[1:]) if fsdp else math.prod(s) for s in mlp)
        assert row["memory_bytes"]["parameters"] == 4.0 * (local + held), row["describe"]
    bad = run_cli_in_process(["plan", "--model", "dlrm-tiny", "--gpus", "2"], tmp_path, check=False)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("scaletrain: error: --model: dlrm-tiny's tables")


@pytest.mark.slow  # three 2-rank launches
def test_recommender_benchmark_runs(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import recommender

    report = recommender.main(["--rows", "3000", "--max-cardinality", "500", "--steps", "3", "--reps", "1",
                               "--batch", "64", "--markdown", str(tmp_path / "B.md")])  # fmt: skip
    assert "| row |" in report and "| table+fused |" in report and "torchrec: not run: give --torchrec DIR" in report
    assert "## Recommenders: sharded embedding tables, against torchrec" in (tmp_path / "B.md").read_text()


def _tables_worker(rank: int, world: int, port: int, out) -> None:
    """Both shardings of a 2-table DLRM on `world` ranks against the unsharded model: outputs of each rank's samples,
    and every gradient (the MLPs' averaged over ranks as data parallelism does, the tables' gathered)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from scaletrain.models.dlrm import DLRMArgs, DLRMSpec
    from scaletrain.parallel.embedding import broadcast_tables, shard_embedding_tables

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        spec = DLRMSpec(DLRMArgs(embedding_dim=4, bottom_mlp=(8,), top_mlp=(8,))).with_data(3, ["a", "b"], [7, 2])
        ref = spec.build("cpu")
        spec.init_weights(ref, 0)
        gen = torch.Generator().manual_seed(1)
        dense, ids = torch.randn(3 * world, 3, generator=gen), torch.randint(0, 1000, (3 * world, 2), generator=gen)
        want = ref(dense, ids)
        want.sum().backward()
        mine = slice(3 * rank, 3 * rank + 3)
        worst = {}
        for how in ("row", "table"):
            model = spec.build("meta")
            tables = shard_embedding_tables(model, "embeddings", mesh, how, world)
            model.to_empty(device="cpu")
            spec.init_weights(model, 0)
            got = model(dense[mine], ids[mine])
            (got.sum() * world).backward()  # the trainer scales the local loss by the data-parallel degree
            diffs = [(got - want[mine]).abs().max().item()]
            for name, p in model.named_parameters():
                grad = p.grad
                if isinstance(grad, DTensor):
                    grad = grad.full_tensor()
                elif not name.startswith("embeddings."):
                    dist.all_reduce(grad)
                    grad = grad / world
                diffs.append((grad - ref.get_parameter(name).grad).abs().max().item())
            held = sorted(n for n, _ in tables.named_parameters())
            whole = dict(broadcast_tables(model))
            if how == "table":
                diffs += [(t - ref.get_parameter(n).detach()).abs().max().item() for n, t in whole.items()]
            worst[how] = (max(diffs), held, sorted(whole))
        out.put((rank, worst))
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.slow  # three gloo processes
def test_sharded_tables_equal_unsharded_with_a_rank_holding_none():
    """3 ranks, 2 tables of 7 and 2 rows: row-wise the third rank holds none of the second table's rows, table-wise
    it holds no table at all; outputs and gradients equal the unsharded model's, and nothing hangs."""
    import torch.multiprocessing as mp

    from scaletrain.launch.local import free_port

    q = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_tables_worker, args=(3, free_port(), q), nprocs=3, join=True, start_method="spawn")
    got = dict(q.get() for _ in range(3))
    for rank, worst in got.items():
        for how, (diff, _, _) in worst.items():
            assert diff < 1e-6, (rank, how, diff)
    assert [got[r]["table"][1] for r in range(3)] == [["tables.a.weight"], ["tables.b.weight"], []]
    tables = ["embeddings.tables.a.weight", "embeddings.tables.b.weight"]
    assert all(got[r]["table"][2] == tables for r in range(3))  # broadcast to every rank from its owner
