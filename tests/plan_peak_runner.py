"""Test helper (not a test): for each job of a JSON list, builds the trainer and measures step 2's peak memory on
every rank (scaletrain.train.peak_memory), one launch for all of them:

    torchrun --nproc-per-node 2 tests/plan_peak_runner.py JOBS.json OUT_DIR

JOBS.json: [{"name": "llama_ddp2", "overrides": [...]}, ...]. Writes OUT_DIR/NAME/peak_rankR.json: {"total": bytes,
category: bytes} at the peak, with the layout the trainer resolved."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from scaletrain.config import load_config
from scaletrain.parallel import init_distributed, shutdown_distributed
from scaletrain.train.peak_memory import measure_step_peak


def main() -> None:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    rt = init_distributed("cpu")
    try:
        for job in jobs:
            started = time.perf_counter()
            trainer, peak = measure_step_peak(load_config(None, job["overrides"]), rt)
            folder = out / job["name"]
            folder.mkdir(parents=True, exist_ok=True)
            record = {**peak, "layout": trainer.layout.to_dict(), "seconds": time.perf_counter() - started}
            (folder / f"peak_rank{rt.rank}.json").write_text(json.dumps(record))
            del trainer
            torch.distributed.barrier()
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
