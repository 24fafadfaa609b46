"""The FSDP2 loop a user would hand-write (the torch FSDP2 tutorial / torchtitan pattern): build on the meta device,
`fully_shard` each transformer block then the root, `to_empty` + init, AdamW, clipping, a loss all-reduce every
`log_every` steps. On GPUs: bf16 parameters through MixedPrecisionPolicy (fp32 reduction) and optionally
torch.compile per block, as `scaletrain train` does with precision.dtype=bf16 parallel.compile=true.

Run under torchrun; rank 0 prints one JSON line with the mean step time of each logging window.
    torchrun --nproc-per-node 2 benchmarks/plain_fsdp.py --steps 60 --log-every 10
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from same_job import DTYPES, WindowClock, adamw, job_args, leave_process_group, loader_for
from scaletrain.config import ModelConfig
from scaletrain.models import model_spec


def main() -> None:
    a = job_args(__doc__)
    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(a.device, torch.cuda.current_device()) if a.device == "cuda" else torch.device("cpu")
    spec = model_spec(ModelConfig(name=a.model))
    model = spec.build("meta")
    mp = (
        MixedPrecisionPolicy()
        if a.dtype == "fp32"
        else MixedPrecisionPolicy(param_dtype=DTYPES[a.dtype], reduce_dtype=torch.float32)
    )
    for block in model.layers.values():
        if a.compile:
            block.compile(fullgraph=True)
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    model.to_empty(device=device)
    spec.init_weights(model, seed=0)
    opt = adamw(model.parameters())
    loader = loader_for(a, rank, world)
    clock = WindowClock(a.log_every)
    for step in range(1, a.steps + 1):
        (batch,) = loader.next_step()
        logits = model(batch.inputs.to(device))
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch.targets.to(device).flatten())
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
