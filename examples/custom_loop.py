"""Your own model and loop on many ranks with `scaletrain.setup()`.

    torchrun --nproc-per-node 2 examples/custom_loop.py            # DDP on 2 CPU ranks (or 2 GPUs)
    torchrun --nproc-per-node 2 examples/custom_loop.py fsdp bf16   # FSDP2 with bf16 compute
    python examples/custom_loop.py                                  # one rank, no launcher

Each rank trains on its own share of a synthetic regression problem; the printed loss is the mean over ranks.
"""

import sys

import torch
import torch.distributed as dist
from torch import nn

import scaletrain


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "auto"
    precision = sys.argv[2] if len(sys.argv) > 2 else "fp32"
    torch.manual_seed(0)  # same initial weights on every rank
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    job = scaletrain.setup(model, optimizer, data_parallel=mode, precision=precision, grad_clip=1.0)

    gen = torch.Generator().manual_seed(1000 + job.dp_rank)  # each data-parallel rank draws different samples
    true_w = torch.linspace(-1, 1, 32)
    accumulation = 2
    for step in range(1, 101):
        for micro in range(accumulation):
            x = torch.randn(16, 32, generator=gen)
            y = (x @ true_w).unsqueeze(1)
            with job.accumulate(sync=micro == accumulation - 1), job.autocast():
                loss = nn.functional.mse_loss(job.model(x.to(job.device)).float(), y.to(job.device))
            job.backward(loss / accumulation)
        job.step()
        if step % 25 == 0:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if job.rank == 0:
                print(f"step {step} loss {mean.item() / job.world_size:.4f}", flush=True)
    # the process group is left cleanly at exit (scaletrain registers that); nothing else to tear down


if __name__ == "__main__":
    main()
