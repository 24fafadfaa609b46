"""Test helper (not a test): trains each job of a JSON list of mixture-of-experts jobs with the trainer's own pieces
(Trainer.build, train_step) and writes, per job, the per-step losses, the expert-load metrics of each step with the
(token, expert) rows every rank's all-to-all sent summed over the ranks, and the gathered full parameters:

    torchrun --nproc-per-node 2 tests/moe_runner.py JOBS.json OUT_DIR

JOBS.json: [{"name": "ep2", "overrides": ["parallel.ep=2", ...]}, ...]. Writes OUT_DIR/NAME/steps.json (rank 0:
[{"loss", "sent", "moe_*"...} per step]), OUT_DIR/NAME/ranks.json (each rank's parameter elements, the
experts' and the rest, as held after sharding) and OUT_DIR/NAME/state.pt (rank 0).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from scaletrain.config import load_config
from scaletrain.monitor import configure_logging
from scaletrain.parallel import full_state_dict, init_distributed, shutdown_distributed
from scaletrain.parallel.expert import dispatchers
from scaletrain.train import Trainer


def sent_over_ranks(trainer) -> int:
    sent = torch.tensor(sum(d.tokens_sent for d in dispatchers([trainer.model.module])), dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sent)
    return int(sent)


def local_param_elements(module) -> dict[str, int]:
    """Parameter elements this rank holds (its shard of each DTensor), the routed experts' and the rest."""
    held = {"experts": 0, "other": 0}
    for name, p in module.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        held["experts" if ".experts." in name else "other"] += local.numel()
    return held


def run_job(overrides: list[str], out: Path, rt) -> None:
    trainer = Trainer.build(load_config(None, overrides), rt)
    held = [None] * rt.world_size
    dist.all_gather_object(held, local_param_elements(trainer.model.module))
    steps, before = [], 0
    for step in range(1, trainer.cfg.train.steps + 1):
        result = trainer.train_step(step)
        sent = sent_over_ranks(trainer)
        loss = trainer.mean_loss(result.loss_sum, result.count)
        metrics = {"loss": loss, "grad_norm": float(result.grad_norm), "sent": sent - before}
        steps.append({**metrics, **trainer.job.step_metrics})
        before = sent
    state = full_state_dict(trainer.model.module)  # a collective: every rank
    if rt.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "steps.json").write_text(json.dumps(steps))
        (out / "ranks.json").write_text(json.dumps(held))
        torch.save(state, out / "state.pt")


def main() -> None:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    rt = init_distributed("cpu")
    configure_logging(rt.rank, all_ranks=False)
    try:
        for job in jobs:
            run_job(job["overrides"], out / job["name"], rt)
            dist.barrier()
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
