"""The optimizer step's arithmetic, in one process: global-norm clipping, a NaN step skipped without touching the
weights or the optimizer, fp16 loss scaling; the gradient norm over FSDP and TP shards (one 2-rank gloo launch for
every case); the learning-rate schedule's exact values."""

from __future__ import annotations

import math


import pytest
import torch
from torch import nn

from scaletrain.config import TrainConfig
from scaletrain.config.layout import Layout
from scaletrain.launch.local import free_port
from scaletrain.parallel.dims import build_mesh
from scaletrain.train.job import Job, global_grad_norm, make_scaler
from scaletrain.train.optim import build_scheduler, lr_factor

ONE = Layout()
CPU = torch.device("cpu")


def _job(optimizer_cls=torch.optim.SGD, grad_clip=0.0, dtype="fp32", **opt_kw):
    """A Job around a 2-weight, 1-bias linear layer on one CPU rank (no mesh, no collectives)."""
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -2.0]]))
        model.bias.fill_(0.5)
    opt = optimizer_cls(model.parameters(), lr=1.0, **opt_kw)
    scaler = make_scaler(ONE, dtype, CPU, init_scale=1024.0, growth_interval=1000)
    return Job(
        model=model,
        optimizer=opt,
        layout=ONE,
        mesh=build_mesh(ONE, "cpu"),
        device=CPU,
        rank=0,
        world_size=1,
        dp_rank=0,
        dtype=dtype,
        grad_clip=grad_clip,
        scaler=scaler,
    )


def _params(job):
    return [p.detach().clone() for p in job.model.parameters()]


def _set_grads(job, weight, bias):
    job.model.weight.grad = torch.tensor([weight])
    job.model.bias.grad = torch.tensor([bias])


def test_step_clips_the_global_norm_and_returns_the_norm_before_clipping():
    job = _job(grad_clip=1.0)  # SGD with lr 1: the update is the (clipped) gradient itself
    before = _params(job)
    _set_grads(job, [3.0, 0.0], 4.0)  # global norm 5 over both parameters, neither alone above 4
    assert job.step().item() == pytest.approx(5.0)
    update = torch.cat([(b - a).flatten() for a, b in zip(_params(job), before)])
    # both parameters scaled by the same 1/5 (clip_grads_with_norm_ divides by norm + 1e-6)
    torch.testing.assert_close(update, torch.tensor([0.6, 0.0, 0.8]), rtol=1e-6, atol=0)
    assert torch.linalg.vector_norm(update).item() == pytest.approx(1.0, rel=1e-6)
    assert all(p.grad is None for p in job.model.parameters())

    before = _params(job)
    _set_grads(job, [0.3, 0.0], 0.4)  # below the limit: untouched
    assert job.step().item() == pytest.approx(0.5)
    update = torch.cat([(b - a).flatten() for a, b in zip(_params(job), before)])
    assert update.tolist() == pytest.approx([0.3, 0.0, 0.4], rel=1e-7)


def test_nonfinite_step_is_skipped_leaving_weights_and_optimizer_state_alone():
    job = _job(torch.optim.AdamW, weight_decay=0.1)
    _set_grads(job, [0.1, 0.2], 0.3)
    job.step()  # AdamW now has moments and a step count
    params = _params(job)
    state = {k: v.clone() for s in job.optimizer.state.values() for k, v in s.items()}
    _set_grads(job, [float("nan"), 0.2], 0.3)
    assert math.isnan(job.step(skip_nonfinite=True).item())
    assert all(torch.equal(a, b) for a, b in zip(_params(job), params, strict=True))
    after = {k: v for s in job.optimizer.state.values() for k, v in s.items()}
    assert all(torch.equal(after[k], state[k]) for k in state)
    assert all(p.grad is None for p in job.model.parameters())
    # without the flag the same gradient reaches the weights: the flag is what protects them
    _set_grads(job, [float("nan"), 0.2], 0.3)
    job.step()
    assert torch.isnan(job.model.weight).any()


def test_fp16_loss_scaling_skips_an_overflowing_step_and_halves_the_scale():
    job = _job(dtype="fp16")
    assert isinstance(job.scaler, torch.amp.GradScaler) and job.scaler.get_scale() == 1024.0
    x = torch.tensor([[1.0, 1.0]])
    before = _params(job)
    job.backward(job.model(x).sum())  # scaled by 1024; gradients: weight [1, 1], bias 1
    job.model.weight.grad[0, 0] = float("inf")  # an fp16 overflow
    assert math.isinf(job.step().item())
    assert all(torch.equal(a, b) for a, b in zip(_params(job), before, strict=True))
    assert job.scaler.get_scale() == 512.0

    job.backward(job.model(x).sum())
    assert job.step().item() == pytest.approx(math.sqrt(3))  # unscaled before the norm
    update = torch.cat([(b - a).flatten() for a, b in zip(_params(job), before)])
    assert update.tolist() == pytest.approx([1.0, 1.0, 1.0])  # the true gradient, not 512 times it
    assert job.scaler.get_scale() == 512.0  # growth only after growth_interval good steps


# --- the gradient norm over shards: 2 gloo ranks, every case in one launch ---


def _norm_worker(rank: int, world: int, port: int, full: dict, out) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))

        def param(grad):
            p = nn.Parameter(torch.zeros_like(grad))
            p.grad = grad
            return p

        def sharded(name, placement):
            return param(distribute_tensor(full[name], mesh, [placement]))

        cases = {
            # FSDP: every parameter Shard(0), an odd row count so the shards are uneven (3 + 2 rows)
            "fsdp": [sharded("w1", Shard(0)), sharded("w2", Shard(0)), sharded("b", Shard(0))],
            # TP: column-wise Shard(0), row-wise Shard(1), a Replicate DTensor and a plain (replicated) norm weight
            "tp": [sharded("w1", Shard(0)), sharded("w2", Shard(1)), sharded("b", Replicate()), param(full["n"])],
            # loss-parallel style: Partial gradients whose sum over ranks is the full gradient
            "partial": [param(DTensor.from_local(full["w1"] / world, mesh, [Partial()]))],
        }
        norms = {name: global_grad_norm(params).item() for name, params in cases.items()}
        # pipeline: each stage holds its own parameters; the squared norms add up over the pp group
        stage = [param(full["w1"])] if rank == 0 else [param(full["w2"]), param(full["b"])]
        norms["pp"] = global_grad_norm(stage, pp_group=dist.group.WORLD).item()
        out.put((rank, norms))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def test_global_grad_norm_over_fsdp_and_tp_shards_equals_the_full_gradients_norm():
    import torch.multiprocessing as mp

    gen = torch.Generator().manual_seed(0)
    full = {
        "w1": torch.randn(5, 3, generator=gen),
        "w2": torch.randn(4, 6, generator=gen),
        "b": torch.randn(6, generator=gen),
        "n": torch.randn(3, generator=gen),
    }
    q = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_norm_worker, args=(2, free_port(), full, q), nprocs=2, join=True, start_method="spawn")
    got = dict(q.get() for _ in range(2))

    def norm(*names):
        return torch.linalg.vector_norm(torch.cat([full[n].flatten() for n in names])).item()

    want = {
        "fsdp": norm("w1", "w2", "b"),
        "tp": norm("w1", "w2", "b", "n"),
        "partial": norm("w1"),
        "pp": norm("w1", "w2", "b"),
    }
    for rank in (0, 1):  # every rank gets the same global norm (it decides clipping and NaN skips alike)
        for case, value in want.items():
            assert got[rank][case] == pytest.approx(value, rel=1e-6, abs=0), (rank, case)


# --- the learning-rate schedule ---


def _cfg(**kw):
    return TrainConfig(**{"steps": 10, "warmup_steps": 4, "min_lr_ratio": 0.1, **kw})


def test_lr_schedule_warms_up_linearly_then_decays_to_min_lr_ratio_on_the_last_step():
    warmup = [0.2, 0.4, 0.6, 0.8]  # (step + 1) / (warmup + 1): step 4 is the first at the peak
    cosine = [lr_factor(s, _cfg()) for s in range(10)]
    assert cosine[:4] == pytest.approx(warmup, abs=1e-12)
    # after warmup, progress (step - 4) / 5 over steps 4..9; cosine: 0.1 + 0.9 * (1 + cos(pi * progress)) / 2
    assert cosine[4:] == pytest.approx(
        [1.0, 0.9140576474687263, 0.6890576474687264, 0.4109423525312737, 0.18594235253127375, 0.1], abs=1e-12
    )
    linear = [lr_factor(s, _cfg(schedule="linear")) for s in range(10)]
    assert linear == pytest.approx([*warmup, 1.0, 0.82, 0.64, 0.46, 0.28, 0.1], abs=1e-12)
    constant = [lr_factor(s, _cfg(schedule="constant")) for s in range(10)]
    assert constant == pytest.approx([*warmup, 1, 1, 1, 1, 1, 1], abs=1e-12)
    # warmup as long as the run or longer: the whole run warms up and never reaches the peak
    for warm in (5, 8):
        short = [lr_factor(s, _cfg(steps=5, warmup_steps=warm)) for s in range(5)]
        assert short == pytest.approx([1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6], abs=1e-12)
    # no warmup: the first step is at the peak
    assert lr_factor(0, _cfg(warmup_steps=0)) == 1.0 and lr_factor(9, _cfg(warmup_steps=0)) == pytest.approx(0.1)

    # what the optimizer sees: step k runs at lr * lr_factor(k), as the trainer reads it before scheduler.step()
    cfg = _cfg(lr=2e-3)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    scheduler = build_scheduler(opt, cfg)
    used = []
    for _ in range(10):
        used.append(scheduler.get_last_lr()[0])
        opt.step()
        scheduler.step()
    assert used == pytest.approx([2e-3 * f for f in cosine], rel=1e-12)


def test_optimizer_kernels_follow_train_optimizer_impl_and_take_the_same_steps():
    """train.optimizer_impl=fused builds AdamW's one-kernel update (foreach by default, and on the meta device where
    the planner lays a model out); both give the same weights after a few steps."""
    from scaletrain.train.optim import build_optimizer

    def trained(impl: str) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        opt = build_optimizer(model, TrainConfig(optimizer_impl=impl))
        x = torch.randn(32, 8)
        for _ in range(3):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return opt, [p.detach() for p in model.parameters()]

    (foreach, a), (fused, b) = trained("foreach"), trained("fused")
    assert foreach.defaults["foreach"] and not foreach.defaults["fused"] and fused.defaults["fused"]
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a, b, strict=True))
    with torch.device("meta"):
        meta = nn.Linear(4, 4)
    assert not build_optimizer(meta, TrainConfig(optimizer_impl="fused")).defaults["fused"]
