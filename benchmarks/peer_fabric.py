"""The same job written for Lightning Fabric (its README loop): Fabric(strategy="ddp"), setup, fabric.backward,
fabric.clip_gradients, a loss all-reduce every `log_every` steps.

    fabric run --accelerator cpu --devices 2 --strategy ddp benchmarks/peer_fabric.py --steps 60
(`fabric run` starts the ranks through torchrun; started with plain `python`, fabric.launch() starts them.)
"""

import os

import torch.nn.functional as F
from lightning_fabric import Fabric

from same_job import WindowClock, adamw, job_args, leave_process_group, loader_for, logits_of, model_on


def main() -> None:
    a = job_args(__doc__)
    fabric = Fabric(accelerator=a.device, strategy="ddp", precision="32-true" if a.dtype == "fp32" else "bf16-mixed")
    if not os.environ.get("LT_CLI_USED"):  # `fabric run` already started the processes
        fabric.launch()
    model, _ = model_on(a, "cpu")
    opt = adamw(model.parameters())
    model, opt = fabric.setup(model, opt)
    loader = loader_for(a, fabric.global_rank, fabric.world_size)
    clock = WindowClock(a.log_every)
    for step in range(1, a.steps + 1):
        (batch,) = loader.next_step()
        logits = logits_of(model, batch.inputs.to(fabric.device))
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch.targets.to(fabric.device).flatten())
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % a.log_every == 0:
            fabric.all_reduce(loss.detach()).item()
            clock.lap()
    if fabric.global_rank == 0:
        clock.report()
    # Fabric leaves the process group to interpreter exit, where gloo ranks aborted now and then on this machine
    leave_process_group()


if __name__ == "__main__":
    main()
