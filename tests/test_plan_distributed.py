"""Predicted model-state bytes per rank equal the bytes of the tensors DDP and FSDP2 actually keep, on 2 gloo
ranks (one launch for every check: process-group start-up is the expensive part)."""

from __future__ import annotations

import socket

import pytest
import torch

from scaletrain.models import PRESETS
from scaletrain.plan.memory import trainer_model_state_bytes

LAYOUTS = [  # (dp_replicate, dp_shard, precision)
    (2, 1, "fp32"), (2, 1, "bf16"), (1, 2, "fp32"), (1, 2, "bf16"),
]


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _worker(rank: int, world: int, port: int, out) -> None:
    import torch.distributed as dist

    from scaletrain.config.schema import ParallelConfig, PrecisionConfig, TrainConfig
    from scaletrain.models import build_model, init_weights
    from scaletrain.parallel.apply import apply_parallelism
    from scaletrain.parallel.dims import ParallelDims, build_mesh
    from scaletrain.parallel.data_parallel import uses_autocast
    from scaletrain.train.optim import build_optimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = []
    try:
        args = PRESETS["tiny"]
        for dpr, dps, dtype in LAYOUTS:
            dims = ParallelDims(dpr, dps, 1, 1)
            mesh = build_mesh(dims, "cpu")
            model = build_model(args, "meta")
            model = apply_parallelism(model, dims, mesh, torch.device("cpu"), ParallelConfig(dp_replicate=dpr,
                                      dp_shard=dps), PrecisionConfig(dtype=dtype),
                                      init_fn=lambda m: init_weights(m, args, seed=0))
            opt = build_optimizer(model, TrainConfig())
            tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(rank))
            ctx = torch.autocast("cpu", dtype=torch.bfloat16) if uses_autocast(dims, dtype) else \
                torch.autocast("cpu", enabled=False)
            with ctx:
                logits = model(tokens)
            torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
            opt.step()
            params = sum(_local_bytes(p) for p in model.parameters())
            grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
            states = sum(_local_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
            results.append({"rank": rank, "layout": (dpr, dps, dtype), "parameters": params, "gradients": grads,
                            "optimizer states": states})
        out.put(results)
    finally:
        dist.barrier()  # a gloo thread may still release a finished collective; destroying now can deadlock
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(2, _free_port(), q), nprocs=2, join=True, start_method="spawn")
    return q.get() + q.get()


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"dpr{x[0]}-dps{x[1]}-{x[2]}")
def test_model_state_bytes_match_sharded_tensors(measured, layout):
    dpr, dps, _ = layout
    predicted = trainer_model_state_bytes(PRESETS["tiny"], tp=1, pp=1, dp_shard=dps)
    rows = [r for r in measured if tuple(r["layout"]) == layout]
    assert len(rows) == 2
    for r in rows:  # the tiny model's dims are all even, so both ranks hold the same bytes
        assert {k: r[k] for k in predicted} == predicted, r
    if dps > 1:
        full = trainer_model_state_bytes(PRESETS["tiny"])
        assert predicted["parameters"] * 2 == full["parameters"]
