"""Test helper (not a test): reads STEPS steps of a dataset with the real loader in every rank of a gloo group and
writes, on rank 0, the global samples of each step (every rank's share, in rank order) and the loader's state.

    torchrun --nproc-per-node N tests/data_runner.py DATA_DIR OUT.json STEPS [STATE.json]

A sample is named by its first input token // seq_len, so the dataset's train tokens must be 0, 1, 2, ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from scaletrain.config.schema import DataConfig
from scaletrain.data import build_loaders

SEQ, BATCH = 8, 16


def main() -> None:
    data, out, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = DataConfig(path=data, seq_len=SEQ, prefetch=2)
    loader, _ = build_loaders(cfg, 256, 3, BATCH, 2, rank, world)
    if len(sys.argv) > 4:
        loader.load_state_dict(json.loads(Path(sys.argv[4]).read_text()))
    got = []
    for _ in range(steps):
        mine = [int(t) // SEQ for mb in loader.next_step() for t in mb.inputs[:, 0]]
        shares: list = [None] * world
        dist.all_gather_object(shares, mine)
        got.append([s for share in shares for s in share])
    if rank == 0:
        out.write_text(json.dumps({"steps": got, "state": loader.state_dict()}))
    loader.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
