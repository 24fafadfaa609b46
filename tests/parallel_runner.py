"""Test helper (not a test): trains each job of a JSON list through the trainer's own pieces (resolve_job,
apply_parallelism, Job, DistributedLoader, forward_backward) and writes, per job, the per-step losses and the
gathered full parameters after the last step. One launch, one process group, several layouts:

    python tests/parallel_runner.py JOBS.json OUT_DIR                       # one process
    torchrun --nproc-per-node 8 tests/parallel_runner.py JOBS.json OUT_DIR  # every job must fit 8 ranks

JOBS.json: [{"name": "pp_gpipe", "overrides": ["parallel.pp=2", ...]}, ...]. Writes OUT_DIR/NAME/losses.json
(rank 0) and OUT_DIR/NAME/state_rankR.pt from one rank per pipeline stage (data-parallel and TP rank 0).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from scaletrain.config import load_config
from scaletrain.data import DistributedLoader, TokenWindows, load_tokens, split_stream
from scaletrain.models import build_model, init_weights
from scaletrain.parallel import (apply_parallelism, build_mesh, dp_coordinates, full_state_dict, init_distributed,
                                 shutdown_distributed)
from scaletrain.train.job import Job
from scaletrain.train.optim import build_optimizer, build_scheduler
from scaletrain.train.preflight import resolve_job
from scaletrain.train.step import forward_backward, sum_over_ranks


def run_job(overrides: list[str], out: Path, rt) -> None:
    cfg = load_config(None, overrides)
    plan = resolve_job(cfg, rt.world_size)
    args, dims = plan.args, plan.dims
    seq, gb = cfg.data.seq_len, cfg.train.global_batch_size
    mesh = build_mesh(dims, "cpu")
    model = apply_parallelism(build_model(args, "meta"), dims, mesh, rt.device, cfg.parallel, cfg.precision,
                              init_fn=lambda m: init_weights(m, args, cfg.run.seed),
                              microbatches=plan.accumulation, seq_len=seq)
    optimizer = build_optimizer(model, cfg.train)
    scheduler = build_scheduler(optimizer, cfg.train)
    dp_rank, dp_size = dp_coordinates(dims, mesh)
    job = Job(model, optimizer, dims, mesh, rt.device, rt.rank, rt.world_size, dp_rank, cfg.precision.dtype,
              cfg.train.grad_clip)
    tokens = load_tokens(cfg.data, args.vocab_size, cfg.run.seed)
    train_tokens, _ = split_stream(tokens, cfg.data.val_fraction)
    loader = DistributedLoader(TokenWindows(train_tokens, seq), gb, plan.micro_batch, dp_rank, dp_size,
                               cfg.run.seed)
    losses = []
    for _ in range(cfg.train.steps):
        loss_sum = forward_backward(job, loader.next_step(), dims.dp / (gb * seq))
        job.step()
        scheduler.step()
        losses.append(sum_over_ranks(loss_sum) / (gb * seq))
    state = full_state_dict(job.model)  # a collective: every rank
    out.mkdir(parents=True, exist_ok=True)
    tp_rank = mesh["tp"].get_local_rank() if dims.tp > 1 else 0
    if dp_rank == 0 and tp_rank == 0:
        torch.save(state, out / f"state_rank{rt.rank}.pt")
    if rt.rank == 0:
        (out / "losses.json").write_text(json.dumps(losses))


def main() -> None:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    rt = init_distributed("cpu")
    try:
        for job in jobs:
            run_job(job["overrides"], out / job["name"], rt)
            torch.distributed.barrier()
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
