"""Predicted model-state bytes per rank equal the bytes of the tensors the trainer actually keeps in a real
training step of 4 micro-batches (its Job, forward_backward and optimizer step), for DDP, FSDP2 and HSDP (sharded
and unsharded accumulation), TP (+SP), PP (looped and V schedules) and 2-D layouts, on gloo ranks. Gradients are
the most held after any micro-batch's backward: p.grad plus the whole gradients FSDP2 keeps on its unsharded
parameters while it accumulates without sync. One launch per world size: process-group start-up is the expensive
part; the 2-rank launch also runs the CPU-offload checks. The pipeline layouts use a 4096-token vocabulary so that
the cost-balanced split is uneven (3 blocks + the embedding, then 1 block + the head): the planner must split as the
trainer does."""

from __future__ import annotations


import pytest
import torch

from scaletrain.config import ModelConfig
from scaletrain.models import model_spec, preset_spec
from scaletrain.launch.local import free_port
from scaletrain.plan.memory import trainer_model_state_bytes

SEQ = 32
ACCUMULATION = 4
# (dp_replicate, dp_shard, tp, pp, precision, schedule, vocab, fsdp_accumulate)
LAYOUTS_2 = [
    (2, 1, 1, 1, "fp32", None, 256, "sharded"),
    (2, 1, 1, 1, "bf16", None, 256, "sharded"),
    (1, 2, 1, 1, "fp32", None, 256, "sharded"),
    (1, 2, 1, 1, "bf16", None, 256, "sharded"),
    (1, 2, 1, 1, "fp32", None, 256, "unsharded"),
    (1, 2, 1, 1, "bf16", None, 256, "unsharded"),
    (1, 1, 2, 1, "fp32", None, 256, "sharded"),
    (1, 1, 2, 1, "bf16", None, 256, "sharded"),
    (1, 1, 1, 2, "fp32", "1F1B", 4096, "sharded"),
    (1, 1, 1, 2, "fp32", "Interleaved1F1B", 4096, "sharded"),
    (1, 1, 1, 2, "fp32", "ZBVZeroBubble", 4096, "sharded"),
]
LAYOUTS_4 = [
    (2, 2, 1, 1, "bf16", None, 256, "sharded"),
    (2, 2, 1, 1, "fp32", None, 256, "unsharded"),
    (1, 2, 2, 1, "bf16", None, 256, "sharded"),
    (1, 2, 2, 1, "fp32", None, 256, "unsharded"),
    (1, 2, 1, 2, "fp32", "1F1B", 4096, "sharded"),
    (2, 1, 1, 2, "fp32", "1F1B", 4096, "sharded"),
    (1, 1, 2, 2, "fp32", "1F1B", 4096, "sharded"),
]
OFFLOAD_STEPS = 10


def _spec(vocab: int):
    return model_spec(ModelConfig(name="tiny", vocab_size=vocab))


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _fsdp_states(model: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]


def _grad_bytes(model: torch.nn.Module) -> int:
    """Gradient bytes the rank holds now: p.grad (sharded under FSDP) plus the whole gradients FSDP2 keeps on its
    unsharded parameters (or upcast to the reduce dtype) while accumulating without gradient sync. A module left
    unsharded (pipeline stages) shows those same unsharded parameters: each tensor is counted once."""
    grads = {id(p.grad): p.grad for p in model.parameters() if p.grad is not None}
    for state in _fsdp_states(model):
        for group in state._fsdp_param_groups:
            for fp in group.fsdp_params:
                held = fp.unsharded_accumulated_grad
                if held is None and hasattr(fp, "_unsharded_param"):
                    held = fp._unsharded_param.grad
                if held is not None:
                    grads[id(held)] = held
    return sum(_local_bytes(g) for g in grads.values())


def _build(spec, dims, mesh, pcfg, dtype: str, microbatches: int):
    from dataclasses import replace

    from scaletrain.config.schema import PrecisionConfig
    from scaletrain.parallel.apply import ParallelPlan, apply_parallelism

    plan = ParallelPlan(replace(dims, accumulation=microbatches), pcfg, PrecisionConfig(dtype=dtype), spec, seq_len=SEQ)
    return apply_parallelism(
        spec.build("meta"), plan, mesh, torch.device("cpu"), lambda m, s=spec: s.init_weights(m, 0)
    )


def _batches(vocab: int, n: int, seed: int) -> list:
    from scaletrain.data.loader import Batch

    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (1, SEQ + 1), generator=gen)
        batches.append(Batch(tokens[:, :-1], tokens[:, 1:]))
    return batches


def _offload_run(rank: int, world: int, offload: bool) -> dict:
    """FSDP2 on every rank, fp32, OFFLOAD_STEPS steps of 2 micro-batches: per-step losses and where the model
    states live after the last step."""
    from scaletrain.config.schema import ParallelConfig, TrainConfig
    from scaletrain.config.layout import Layout
    from scaletrain.parallel.dims import build_mesh
    from scaletrain.train.job import Job
    from scaletrain.train.optim import build_optimizer
    from scaletrain.tasks.causal_lm import CausalLM
    from scaletrain.train.step import forward_backward, sum_over_ranks

    spec = _spec(256)
    dims = Layout(1, world, 1, 1)
    mesh = build_mesh(dims, "cpu")
    pm = _build(spec, dims, mesh, ParallelConfig(dp_shard=world, cpu_offload=offload), "fp32", 1)
    opt = build_optimizer(pm.module, TrainConfig())
    job = Job(model=pm.module, optimizer=opt, layout=dims, mesh=mesh, device=torch.device("cpu"), rank=rank,
              world_size=world, dp_rank=rank, dtype="fp32")  # fmt: skip
    losses = []
    for step in range(OFFLOAD_STEPS):
        loss = forward_backward(job, CausalLM(), _batches(256, 2, 1000 * step + rank), 1.0 / (2 * SEQ * world))
        job.step()
        losses.append(sum_over_ranks(loss) / (2 * SEQ * world))
    policies = [type(g.offload_policy).__name__ for st in _fsdp_states(pm.module) for g in st._fsdp_param_groups]
    shards = {id(p): p.to_local() for p in pm.module.parameters()}
    states_are_shards = all(  # AdamW's moments are DTensors sharded as their parameter, local part on the CPU
        v.to_local().device.type == "cpu" and v.to_local().shape == shards[id(p)].shape
        for p, st in opt.state.items()
        for k, v in st.items()
        if k in ("exp_avg", "exp_avg_sq")
    )
    return {
        "losses": losses,
        "policies": policies,
        "units": len(_fsdp_states(pm.module)),
        "params_on": sorted({t.device.type for t in shards.values()}),
        "states_are_shards": states_are_shards and len(opt.state) == len(shards),
    }


def _worker(rank: int, world: int, port: int, layouts: list, out) -> None:
    import torch.distributed as dist

    from scaletrain.config.schema import ParallelConfig, TrainConfig
    from scaletrain.config.layout import Layout
    from scaletrain.parallel.dims import build_mesh
    from scaletrain.train.job import Job
    from scaletrain.train.optim import build_optimizer
    from scaletrain.tasks.causal_lm import CausalLM
    from scaletrain.train.step import forward_backward

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results: list = []
    try:
        for layout in layouts:
            dpr, dps, tp, pp, dtype, schedule, vocab, accumulate = layout
            spec = _spec(vocab)
            dims = Layout(dpr, dps, tp, pp)
            mesh = build_mesh(dims, "cpu")
            pcfg = ParallelConfig(
                dp_replicate=dpr,
                dp_shard=dps,
                tp=tp,
                pp=pp,
                sequence_parallel=tp > 1,
                fsdp_accumulate=accumulate,
                **({"pp_schedule": schedule} if schedule else {}),
            )
            pm = _build(spec, dims, mesh, pcfg, dtype, ACCUMULATION)
            model = pm.module
            opt = build_optimizer(model, TrainConfig())
            job = Job(
                model=model,
                optimizer=opt,
                layout=dims,
                mesh=mesh,
                device=torch.device("cpu"),
                rank=rank,
                world_size=world,
                dp_rank=0,
                dtype=dtype,
                pipeline=pm.pipeline,
                loss_parallel=pm.loss_parallel,
                fsdp_accumulate=accumulate,
            )
            held = [0]

            def measure(_i: int = 0, model=model, held=held) -> None:
                held[0] = max(held[0], _grad_bytes(model))

            if pm.pipeline is not None:  # the schedule's REDUCE_GRAD action ends each stage's accumulation
                for stage in pm.pipeline.stages:
                    reduce = stage.perform_reduce_grad
                    stage.perform_reduce_grad = lambda f, reduce=reduce: (measure(), reduce(f))[1]
            forward_backward(
                job, CausalLM(), _batches(vocab, ACCUMULATION, 0), 1.0 / (ACCUMULATION * SEQ), after_backward=measure
            )
            measure()
            job.step()  # creates the optimizer states, then frees the gradients
            params = sum(_local_bytes(p) for p in model.parameters())
            states = sum(_local_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
            results.append(
                {
                    "layout": layout,
                    "pp_rank": mesh["pp"].get_local_rank() if pp > 1 else 0,
                    "parameters": params,
                    "gradients": held[0],
                    "optimizer states": states,
                }
            )
        if world == 2:
            results.append({"offload": [_offload_run(rank, world, False), _offload_run(rank, world, True)]})
        out.put(results)
    finally:
        dist.barrier()  # a gloo thread may still release a finished collective; destroying now can deadlock
        dist.destroy_process_group()


def _launch(world: int, layouts: list) -> list[dict]:
    import torch.multiprocessing as mp

    q = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(world, free_port(), layouts, q), nprocs=world, join=True, start_method="spawn")
    return [r for _ in range(world) for r in q.get()]


@pytest.fixture(scope="module")
def measured_2() -> list[dict]:
    return _launch(2, LAYOUTS_2)


@pytest.fixture(scope="module")
def measured_4() -> list[dict]:
    return _launch(4, LAYOUTS_4)


def _check(measured: list[dict], layout: tuple, world: int) -> None:
    dpr, dps, tp, pp, _, schedule, vocab, accumulate = layout
    rows = [r for r in measured if tuple(r.get("layout", ())) == layout]
    assert len(rows) == world
    v_shaped = schedule == "ZBVZeroBubble"
    stages = 1 if schedule in (None, "1F1B") else 2
    shape = _spec(vocab).shape()
    for r in rows:  # the tiny model's dims are all even, so every data-parallel/TP rank holds the same bytes
        predicted = trainer_model_state_bytes(
            shape, tp, pp, dps, SEQ, stages, v_shaped, r["pp_rank"], ACCUMULATION, accumulate
        )
        assert {k: r[k] for k in predicted} == predicted, r
    if pp > 1:  # the pipeline ranks really hold different parts, and the planner's largest is the largest
        by_rank = {r["pp_rank"]: r["parameters"] for r in rows}
        assert len(set(by_rank.values())) > 1
        assert trainer_model_state_bytes(shape, tp, pp, dps, SEQ, stages, v_shaped)["parameters"] == max(
            by_rank.values()
        )


def _ids(x) -> str:
    dpr, dps, tp, pp, dtype, schedule, vocab, accumulate = x
    name = f"dpr{dpr}-dps{dps}-tp{tp}-pp{pp}-{dtype}" + (f"-{schedule}" if schedule else "")
    return name + (f"-{accumulate}" if dps > 1 else "")


@pytest.mark.parametrize("layout", LAYOUTS_2, ids=_ids)
def test_model_state_bytes_match_the_trainers_tensors_on_2_ranks(measured_2, layout):
    _check(measured_2, layout, 2)


@pytest.mark.slow  # the 4-rank launch; the 2-rank layouts check the same formulas
@pytest.mark.parametrize("layout", LAYOUTS_4, ids=_ids)
def test_model_state_bytes_match_the_trainers_tensors_on_4_ranks(measured_4, layout):
    _check(measured_4, layout, 4)


def _measured(measured: list[dict], layout: tuple, key: str) -> int:
    return next(r[key] for r in measured if tuple(r.get("layout", ())) == layout)


@pytest.mark.slow  # needs the 4-rank launch
def test_sharded_accumulation_keeps_1_over_n_of_ddps_gradients(measured_2, measured_4):
    ddp = _measured(measured_2, (2, 1, 1, 1, "fp32", None, 256, "sharded"), "gradients")
    assert _measured(measured_2, (1, 2, 1, 1, "fp32", None, 256, "sharded"), "gradients") * 2 == ddp
    assert _measured(measured_4, (2, 2, 1, 1, "bf16", None, 256, "sharded"), "gradients") * 2 == ddp
    # no-sync accumulation holds every whole gradient, as DDP does
    assert _measured(measured_2, (1, 2, 1, 1, "fp32", None, 256, "unsharded"), "gradients") == ddp
    assert _measured(measured_4, (2, 2, 1, 1, "fp32", None, 256, "unsharded"), "gradients") == ddp


def test_cpu_offload_trains_the_same_with_every_unit_offloaded(measured_2):
    """On a CPU host every tensor is on the CPU anyway; what is checked is that the offload policy reaches every
    FSDP unit (each block and the root), that the optimizer's states are the sharded CPU tensors of the parameters,
    and that the losses of 10 fp32 steps equal those without offload."""
    offload_runs = [r for r in measured_2 if "offload" in r]
    assert offload_runs, "no record of the offload run: nothing below would be checked"
    for r in offload_runs:
        plain, offloaded = r["offload"]
        assert len(plain["losses"]) == len(offloaded["losses"]) == 10
        assert offloaded["losses"] == pytest.approx(plain["losses"], rel=1e-6, abs=1e-6)
        assert plain["policies"] == ["OffloadPolicy"] * plain["units"]
        assert offloaded["policies"] == ["CPUOffloadPolicy"] * offloaded["units"]
        assert offloaded["units"] == _spec(256).n_blocks + 1
        assert offloaded["params_on"] == ["cpu"] and offloaded["states_are_shards"]


def test_fsdp_halves_what_one_rank_keeps():
    full = trainer_model_state_bytes(preset_spec("tiny").shape())
    assert trainer_model_state_bytes(preset_spec("tiny").shape(), dp_shard=2)["parameters"] * 2 == full["parameters"]
