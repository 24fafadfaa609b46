"""One rank of test_checkpoint_async.py (under torchrun, 2 gloo ranks): async saves through the writer process
while training mutates the weights right after each save; writes what it saw as JSON (rank 0)."""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from scaletrain.checkpoint import CheckpointManager
from scaletrain.checkpoint.manager import _state_dicts
from scaletrain.checkpoint.safe_load import load_dcp
from scaletrain.config.schema import CheckpointConfig
from torch.distributed.checkpoint import _async_process_executor as process_executor


def main(root: Path, out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same replica on both ranks
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train_step() -> None:
        model(torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))).square().mean().backward()
        for p in model.parameters():  # replicas stay equal: average the gradients by hand
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        opt.step()
        opt.zero_grad()

    train_step()  # AdamW's state exists
    cfg = CheckpointConfig(async_save=True, async_writer="process", interval_steps=1, keep=0)
    mgr = CheckpointManager(cfg, root, rank, dist.get_world_size(), {"layout": "none"})
    expected, save_s, polls_s = {}, [], []
    for step in (1, 2, 3):
        model_sd, optim_sd, _, _ = _state_dicts(model, opt)
        expected[step] = {k: v.clone() for k, v in {**model_sd, **optim_sd}.items() if isinstance(v, torch.Tensor)}
        t0 = time.perf_counter()
        mgr.save(step, model, opt, {"loader": {}})
        save_s.append(time.perf_counter() - t0)
        train_step()  # the update waits for the staging copy (the optimizer's pre-hook), then changes every weight
        t0 = time.perf_counter()
        mgr.poll(step)
        polls_s.append(time.perf_counter() - t0)
    writer = process_executor._CHECKPOINT_PROCESS  # started when the manager opened
    mgr.close()
    stopped = writer is not None and not writer._save_process.is_alive()
    # what each checkpoint holds: the weights at its step, not those the following update wrote
    matches = {}
    for step in (1, 2, 3):
        fresh = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        fresh(torch.zeros(1, 64)).sum().backward()
        fresh_opt.step()  # the optimizer state exists to load into
        model_sd, optim_sd, _, _ = _state_dicts(fresh, fresh_opt)
        state = {"model": model_sd, "optim": optim_sd}
        load_dcp(state, root / f"step_{step:08d}")
        got = {**state["model"], **state["optim"]}
        matches[step] = all(torch.equal(got[k], v) for k, v in expected[step].items())
    if rank == 0:
        out.write_text(
            json.dumps(
                {
                    "matches": matches,
                    "writer_started": writer is not None,
                    "writer_stopped": stopped,
                    "save_s": save_s,
                    "poll_s": polls_s,
                    "staging_wait_s": mgr.staging_wait_s,
                    "committed": sorted(p.name for p in root.iterdir()),
                }
            )
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
