"""The planner's LoRA (`plan --lora-rank R`, `[lora]` of a job config): the model-state bytes it predicts per rank
(frozen base weights; adapters' weights, gradients and AdamW states) equal the bytes of the tensors the trainer keeps
for the same adapted model (peft's layers, models/lora.py) in a real step of 4 micro-batches, for DDP, FSDP2
(sharded and unsharded accumulation) and PP on 2 gloo ranks (one launch); and the command prints it."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import FAST, run_cli_in_process
from test_plan_distributed import ACCUMULATION, SEQ, _batches, _grad_bytes, _local_bytes, _spec

from scaletrain.config.schema import LoraConfig
from scaletrain.launch.local import free_port
from scaletrain.plan.lora import adapter_params, lora_shape
from scaletrain.plan.memory import trainer_model_state_bytes

RANK = 4
# (dp_replicate, dp_shard, pp, schedule, vocab, fsdp_accumulate)
LAYOUTS = [
    (2, 1, 1, None, 256, "sharded"),
    (1, 2, 1, None, 256, "sharded"),
    (1, 2, 1, None, 256, "unsharded"),
    (1, 1, 2, "1F1B", 4096, "sharded"),
]


def _worker(rank: int, world: int, port: int, out) -> None:
    import torch.distributed as dist

    from scaletrain.config.layout import Layout
    from scaletrain.config.schema import ParallelConfig, PrecisionConfig, TrainConfig
    from scaletrain.models.lora import add_lora, init_adapters
    from scaletrain.parallel.apply import ParallelPlan, apply_parallelism
    from scaletrain.parallel.dims import build_mesh
    from scaletrain.tasks.causal_lm import CausalLM
    from scaletrain.train.job import Job
    from scaletrain.train.optim import build_optimizer
    from scaletrain.train.step import forward_backward

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = []
    try:
        for layout in LAYOUTS:
            dpr, dps, pp, schedule, vocab, accumulate = layout
            spec = _spec(vocab)
            dims = Layout(dpr, dps, 1, pp, accumulation=ACCUMULATION)
            mesh = build_mesh(dims, "cpu")
            pcfg = ParallelConfig(
                dp_replicate=dpr,
                dp_shard=dps,
                pp=pp,
                fsdp_accumulate=accumulate,
                **({"pp_schedule": schedule} if schedule else {}),
            )
            plan = ParallelPlan(dims, pcfg, PrecisionConfig(dtype="fp32"), spec, seq_len=SEQ)
            model = add_lora(spec.build("meta"), LoraConfig(rank=RANK), spec)

            def init(m, spec=spec) -> None:
                spec.init_weights(m, 0)
                init_adapters(m, 0)

            pm = apply_parallelism(model, plan, mesh, torch.device("cpu"), init)
            model = pm.module
            opt = build_optimizer(model, TrainConfig())
            job = Job(model=model, optimizer=opt, layout=dims, mesh=mesh, device=torch.device("cpu"), rank=rank,
                      world_size=world, dp_rank=0, dtype="fp32", pipeline=pm.pipeline,
                      loss_parallel=pm.loss_parallel, fsdp_accumulate=accumulate)  # fmt: skip
            held = [0]

            def measure(_i: int = 0, model=model, held=held) -> None:
                held[0] = max(held[0], _grad_bytes(model))

            if pm.pipeline is not None:  # the schedule's REDUCE_GRAD action ends each stage's accumulation
                for stage in pm.pipeline.stages:
                    reduce = stage.perform_reduce_grad
                    stage.perform_reduce_grad = lambda f, reduce=reduce: (measure(), reduce(f))[1]
            batches = _batches(vocab, ACCUMULATION, 0)
            forward_backward(job, CausalLM(), batches, 1.0 / (ACCUMULATION * SEQ), after_backward=measure)
            measure()
            job.step()
            states = sum(_local_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
            results.append(
                {
                    "layout": layout,
                    "pp_rank": mesh["pp"].get_local_rank() if pp > 1 else 0,
                    "parameters": sum(_local_bytes(p) for p in model.parameters()),
                    "gradients": held[0],
                    "optimizer states": states,
                    "trained": sum(p.numel() for p in model.parameters() if p.requires_grad),  # DTensor: global
                }
            )
        out.put(results)
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    import torch.multiprocessing as mp

    q = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(2, free_port(), q), nprocs=2, join=True, start_method="spawn")
    return [r for _ in range(2) for r in q.get()]


def _one_step_bytes(overrides: list[str]):
    """(trainer, model-state bytes it keeps) for one process: its parameters as stored (an NF4 base's own parts),
    the gradients after a step's backward and the AdamW states after the step."""
    from scaletrain.config import load_config
    from scaletrain.parallel.runtime import shutdown_distributed
    from scaletrain.train import Trainer
    from scaletrain.train.step import forward_backward, step_count

    trainer = Trainer.build(load_config(None, [*FAST, *overrides]))
    model, job = trainer.model.module, trainer.job
    try:
        mb = trainer.loader.next_step()
        forward_backward(job, trainer.task, mb, trainer.layout.grad_average / step_count(job, trainer.task, mb))
        gradients = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        job.step(skip_nonfinite=False)
    finally:
        shutdown_distributed()  # Trainer.build's one-rank group
    states = sum(_local_bytes(v) for s in job.optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    return trainer, {
        "parameters": sum(_stored_bytes(p) for p in model.parameters()),
        "gradients": gradients,
        "optimizer states": states,
    }


def test_one_process_lora_trainer_keeps_what_the_planner_predicts(tmp_path):
    """The trainer itself (Trainer.build, one process): its parameters, the gradients after a step's backward and
    the AdamW states after the step, in bytes, as trainer_model_state_bytes predicts them with LoRA."""
    trainer, measured = _one_step_bytes(["lora.rank=4", "lora.targets=['wq','wv','w2']", f"run.output_dir={tmp_path}"])
    lora = lora_shape(4, ["wq", "wv", "w2"])
    assert measured == trainer_model_state_bytes(trainer.spec.shape(), seq_len=trainer.cfg.data.seq_len, lora=lora)


@pytest.mark.slow  # one 2-rank launch (~25 s); the one-process check above stays fast
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"dpr{x[0]}-dps{x[1]}-pp{x[2]}-{x[5]}")
def test_lora_model_state_bytes_match_the_trainers_tensors_on_2_ranks(measured, layout):
    dpr, dps, pp, schedule, vocab, accumulate = layout
    rows = [r for r in measured if tuple(r["layout"]) == layout]
    assert len(rows) == 2
    shape, lora = _spec(vocab).shape(), lora_shape(RANK)
    for r in rows:
        predicted = trainer_model_state_bytes(
            shape, 1, pp, dps, SEQ, 1, False, r["pp_rank"], ACCUMULATION, accumulate, lora=lora
        )
        assert {k: r[k] for k in predicted} == predicted, r
    if pp == 1:  # every adapter of the model, as the planner counts them
        assert rows[0]["trained"] == adapter_params(shape, lora)


def test_plan_lora_rank_keeps_the_base_and_trains_adapters_only(tmp_path):
    args = ["plan", "--model", "llama-8b", "--gpus", "8", "--seq-len", "4096", "--global-batch", "64", "--json"]
    full = json.loads(run_cli_in_process(args, tmp_path).stdout)
    lora = json.loads(run_cli_in_process([*args, "--lora-rank", "16"], tmp_path).stdout)
    assert full["workload"]["lora"] is None
    assert lora["workload"]["lora"]["rank"] == 16
    # 16 x (in + out) of q, k, v, o, gate, up, down in 32 blocks of Llama 3 8B
    assert lora["workload"]["lora"]["adapter_params"] == 32 * 16 * (
        2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336)
    )
    by_layout = {r["describe"]: r["memory_bytes"] for r in full["layouts"]}
    same = [(r["memory_bytes"], by_layout[r["describe"]]) for r in lora["layouts"] if r["describe"] in by_layout]
    assert same, "no layout in both tables"
    for with_lora, without in same:
        assert with_lora["optimizer states"] < without["optimizer states"] / 100
        assert with_lora["gradients"] < without["gradients"]
        assert without["parameters"] <= with_lora["parameters"] < without["parameters"] * 1.01
    assert all(r["layout"]["cp"] == 1 for r in lora["layouts"])  # what the trainer runs (TP too: adapters follow)
    text = run_cli_in_process([*args[:-1], "--lora-rank", "16"], tmp_path).stdout
    assert "LoRA rank 16 on q, k, v, gate, up, o, down: 41.94 M adapter params (0.52% of the base)" in text


def test_plan_reads_lora_from_a_job_config(tmp_path):
    args = ["plan", "model.name=tiny", "lora.rank=4", "lora.targets=['wq','wv']", "--gpus", "2", "--json"]
    out = json.loads(run_cli_in_process(args, tmp_path).stdout)
    assert out["workload"]["lora"]["targets"] == ["q", "v"]
    bad = run_cli_in_process(
        ["plan", "model.name=tiny", "lora.rank=4", "lora.targets=['norm']", "--gpus", "2"], tmp_path, check=False
    )
    assert bad.returncode == 2 and "lora.targets: the planner knows no block linear 'norm'" in bad.stderr


QLORA_DIMS = ["model.dim=256", "model.ffn_dim=512", "model.n_kv_heads=4"]


def _stored_bytes(t: torch.Tensor) -> int:
    """Bytes a parameter stores: an NF4 tensor's inner tensors (codes, scales, their scales, mean, table)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    if type(t).__name__ == "NF4Tensor":
        return sum(getattr(t, name).nbytes for name in t.__tensor_flatten__()[0])
    return t.numel() * t.element_size()


@pytest.mark.parametrize("shape, shards", [((256, 256), 1), ((512, 256), 2), ((1024, 512), 4)])
def test_nf4_bytes_are_torchaos_of_each_fsdp_shard(shape, shards):
    """plan/lora.py nf4_bytes is exact for an NF4 weight and for each of its FSDP2 row shards (NF4's own chunk)."""
    from torchao.quantization import to_nf4

    from scaletrain.plan.lora import nf4_bytes

    q = to_nf4(torch.randn(shape))
    for part in q.chunk(shards, dim=0):
        assert _stored_bytes(part) == nf4_bytes(part.numel())


def test_one_process_qlora_trainer_keeps_what_the_planner_predicts(tmp_path):
    """QLoRA (lora.quantize='nf4'): the trainer's parameters (the 4-bit base as stored), gradients and AdamW states
    in bytes, as trainer_model_state_bytes predicts them; the base about 7.8x smaller than fp32."""
    lora = ["lora.rank=4", "lora.targets=['wq','wv','w2']", "lora.quantize=nf4"]
    trainer, measured = _one_step_bytes([*QLORA_DIMS, *lora, f"run.output_dir={tmp_path}"])
    model, cfg = trainer.model.module, trainer.cfg
    shape = trainer.spec.shape()
    quantized = lora_shape(4, ["wq", "wv", "w2"], quantize="nf4")
    assert measured == trainer_model_state_bytes(shape, seq_len=cfg.data.seq_len, lora=quantized)
    plain = trainer_model_state_bytes(shape, seq_len=cfg.data.seq_len, lora=lora_shape(4, ["wq", "wv", "w2"]))
    nf4 = [p for p in model.parameters() if type(p).__name__ == "NF4Tensor"]
    saved = plain["parameters"] - measured["parameters"]
    assert len(nf4) == 3 * shape.n_layers and saved == pytest.approx(sum(4 * p.numel() - _stored_bytes(p) for p in nf4))
    assert sum(4 * p.numel() for p in nf4) / sum(_stored_bytes(p) for p in nf4) > 7.5


def test_plan_lora_quantize_shrinks_the_base_and_keeps_tp_out(tmp_path):
    args = ["plan", "--model", "llama-70b", "--gpus", "8", "--seq-len", "4096", "--global-batch", "64", "--json"]
    lora = json.loads(run_cli_in_process([*args, "--lora-rank", "16"], tmp_path).stdout)
    qlora = json.loads(run_cli_in_process([*args, "--lora-rank", "16", "--lora-quantize", "nf4"], tmp_path).stdout)
    assert qlora["workload"]["lora"]["quantize"] == "nf4" and lora["workload"]["lora"]["quantize"] == "none"
    assert all(r["layout"]["tp"] == 1 for r in qlora["layouts"])  # what the trainer runs: a 4-bit base is not TP-split
    by_layout = {r["describe"]: r["memory_bytes"] for r in lora["layouts"]}
    same = [(r["memory_bytes"], by_layout[r["describe"]]) for r in qlora["layouts"] if r["describe"] in by_layout]
    assert same, "no layout in both tables"
    for four_bit, fp32 in same:
        # 4.1 bits instead of 32 for the projections (~91% of Llama 70B's weights), fp32 embeddings and norms
        assert 0.12 * fp32["parameters"] < four_bit["parameters"] < 0.2 * fp32["parameters"]
        assert four_bit["optimizer states"] == fp32["optimizer states"]
    bad = run_cli_in_process([*args[:-1], "--lora-quantize", "nf4"], tmp_path, check=False)
    assert bad.returncode == 2 and "--lora-quantize: a 4-bit base is LoRA's (QLoRA)" in bad.stderr


def test_plan_lora_quantize_places_only_whole_nf4_shards(tmp_path):
    """A 4-bit base splits into FSDP2 shards of whole NF4 blocks only (the trainer refuses others): a 256-wide model's
    256 x 256 projections (4 x 16384 weights) shard at most 4 ways, so 8 GPUs plan HSDP or DDP, never FSDP 8."""
    args = ["plan", "model.name=tiny", *QLORA_DIMS, "lora.rank=4", "lora.quantize=nf4", "--gpus", "8", "--json"]
    out = json.loads(run_cli_in_process(args, tmp_path).stdout)
    shards = {r["layout"]["dp_shard"] * r["layout"]["cp"] for r in out["layouts"]}
    assert shards and max(shards) == 4 and shards <= {1, 2, 4}
