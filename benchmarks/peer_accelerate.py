"""The same job written for Hugging Face Accelerate (its README loop): Accelerator, prepare, accelerator.backward,
clip_grad_norm_, a loss reduce every `log_every` steps. On CPU ranks it runs DDP over gloo.

    accelerate launch --multi_gpu --num_processes 2 benchmarks/peer_accelerate.py --steps 60
(with no GPU the ranks see cpu=True below; `accelerate launch --cpu` alone starts one process: its multi-CPU path
needs mpirun.)
"""

import torch.nn.functional as F
from accelerate import Accelerator

from same_job import WindowClock, adamw, job_args, leave_process_group, loader_for, logits_of, model_on


def main() -> None:
    a = job_args(__doc__)
    accelerator = Accelerator(cpu=a.device == "cpu", mixed_precision="no" if a.dtype == "fp32" else a.dtype)
    model, _ = model_on(a, "cpu")
    opt = adamw(model.parameters())
    model, opt = accelerator.prepare(model, opt)
    # the shared loader already gives each rank its share: not wrapped by prepare(), which would re-shard it
    loader = loader_for(a, accelerator.process_index, accelerator.num_processes)
    clock = WindowClock(a.log_every)
    for step in range(1, a.steps + 1):
        (batch,) = loader.next_step()
        logits = logits_of(model, batch.inputs.to(accelerator.device))
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch.targets.to(accelerator.device).flatten())
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % a.log_every == 0:
            accelerator.reduce(loss.detach(), reduction="mean").item()
            clock.lap()
    if accelerator.is_main_process:
        clock.report()
    accelerator.end_training()
    leave_process_group()  # Accelerate leaves the group to interpreter exit; same teardown as every runner


if __name__ == "__main__":
    main()
