"""The baseline a user would hand-write: torch DDP, AdamW, clipping, a loss all-reduce every `log_every` steps.

Same model definition, init, data windows and global batch as `scaletrain train` with parallel.dp_replicate=N.
Run under torchrun; rank 0 prints one JSON line with the mean step time of each logging window.
    torchrun --nproc-per-node 2 benchmarks/plain_ddp.py --steps 60 --log-every 10
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from same_job import WindowClock, adamw, job_args, leave_process_group, loader_for, model_on


def main() -> None:
    a = job_args(__doc__)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, _ = model_on(a, "cpu")
    model = DistributedDataParallel(model)
    opt = adamw(model.parameters())
    loader = loader_for(a, rank, world)
    clock = WindowClock(a.log_every)
    for step in range(1, a.steps + 1):
        (batch,) = loader.next_step()
        logits = model(batch.inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % a.log_every == 0:
            dist.all_reduce(logged := loss.detach())
            logged.item()  # the value a user prints; waits for the device, as a log line does
            clock.lap()
    if rank == 0:
        clock.report()
    leave_process_group()


if __name__ == "__main__":
    main()
