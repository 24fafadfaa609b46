"""Test helper (not a test): trains each job of a JSON list with the trainer itself (Trainer.build and
train_step, without the loop's outputs) and writes, per job, the per-step losses and the gathered full parameters
after the last step. One launch, one process group, several layouts:

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
from scaletrain.parallel import full_state_dict, init_distributed, shutdown_distributed
from scaletrain.train import Trainer


def run_job(overrides: list[str], out: Path, rt) -> None:
    trainer = Trainer.build(load_config(None, overrides), rt)
    losses = [trainer.mean_loss(trainer.train_step(step).loss_sum) for step in range(1, trainer.cfg.train.steps + 1)]
    state = full_state_dict(trainer.model.module)  # a collective: every rank
    out.mkdir(parents=True, exist_ok=True)
    tp_rank = trainer.mesh["tp"].get_local_rank() if trainer.dims.tp > 1 else 0
    if trainer.job.dp_rank == 0 and tp_rank == 0:
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
