"""The same job written for `scaletrain.setup()` (examples/hf_causal_lm.py's loop): FSDP2 per decoder layer of a
transformers LlamaForCausalLM, job.backward, job.step (clip 1.0), a loss all-reduce every `log_every` steps.

    torchrun --nproc-per-node 2 benchmarks/setup_hf.py --hf --steps 60          # FSDP2
    torchrun --nproc-per-node 2 benchmarks/setup_hf.py --hf --steps 60 --ddp    # DDP, to set beside the peers'
"""

import sys


import torch.distributed as dist
import torch.nn.functional as F

import scaletrain
from same_job import WindowClock, adamw, job_args, leave_process_group, loader_for, logits_of, model_on


def main() -> None:
    ddp = "--ddp" in sys.argv  # the shared job arguments stay the same for every runner
    if ddp:
        sys.argv.remove("--ddp")
    a = job_args(__doc__)
    model, _ = model_on(a, "cpu")
    job = scaletrain.setup(
        model,
        adamw(model.parameters()),
        data_parallel="ddp" if ddp else "fsdp",
        precision=a.dtype,
        device=a.device,
        grad_clip=1.0,
    )
    loader = loader_for(a, job.dp_rank, job.dp_size)
    clock = WindowClock(a.log_every)
    for step in range(1, a.steps + 1):
        (batch,) = loader.next_step()
        with job.autocast():
            logits = logits_of(job.model, batch.inputs.to(job.device))
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch.targets.to(job.device).flatten())
        job.backward(loss)
        job.step()
        if step % a.log_every == 0:
            dist.all_reduce(loss.detach())
            clock.lap()
    if job.rank == 0:
        clock.report()
    leave_process_group()


if __name__ == "__main__":
    main()
