"""Test helper (not a test): trains each job of a JSON list with the trainer on one rank (Trainer.build and
train_step, as tests/parallel_runner.py) and records what a reference needs to replay it: every micro-batch the
trainer's loader handed out, and per step the mean loss, learning rate and pre-clip gradient norm.

    python tests/reference_runner.py JOBS.json OUT_DIR    # one process, a one-rank gloo group

JOBS.json: [{"name": "tiny", "overrides": ["train.steps=12", ...]}, ...]. Writes OUT_DIR/NAME/steps.json
([{"loss", "lr", "grad_norm"}] per step) and OUT_DIR/NAME/batches.pt ([[(inputs, targets), ...] per step]).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from scaletrain.config import load_config
from scaletrain.parallel import init_distributed, shutdown_distributed
from scaletrain.train import Trainer


def run_job(overrides: list[str], out: Path, rt) -> None:
    trainer = Trainer.build(load_config(None, overrides), rt)
    drawn: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    next_step = trainer.loader.next_step

    def recording_next_step():
        micro_batches = next_step()
        drawn.append([(mb.inputs.clone(), mb.targets.clone()) for mb in micro_batches])
        return micro_batches

    trainer.loader.next_step = recording_next_step  # what train_step reads, recorded as it is read
    steps = []
    for step in range(1, trainer.cfg.train.steps + 1):
        result = trainer.train_step(step)
        steps.append(
            {
                "loss": trainer.mean_loss(result.loss_sum, result.count),
                "lr": result.lr,
                "grad_norm": float(result.grad_norm),
            }
        )
    trainer.loader.close()
    out.mkdir(parents=True, exist_ok=True)
    (out / "steps.json").write_text(json.dumps(steps))
    torch.save(drawn, out / "batches.pt")


def main() -> None:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    rt = init_distributed("cpu")
    assert rt.world_size == 1, "the reference replays a one-rank run"
    try:
        for job in jobs:
            run_job(job["overrides"], out / job["name"], rt)
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
