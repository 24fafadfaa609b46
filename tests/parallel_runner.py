"""Test helper (not a test): trains each job of a JSON list with the trainer itself (Trainer.build and
train_step, without the loop's outputs) and writes, per job, the per-step losses and the gathered full parameters
after the last step. One launch, one process group, several layouts:

    python tests/parallel_runner.py JOBS.json OUT_DIR                       # one process
    torchrun --nproc-per-node 8 tests/parallel_runner.py JOBS.json OUT_DIR  # every job must fit 8 ranks

JOBS.json: [{"name": "pp_gpipe", "overrides": ["parallel.pp=2", ...]}, ...]. Writes OUT_DIR/NAME/losses.json
(rank 0) and OUT_DIR/NAME/state_rankR.pt from one rank per pipeline stage (data-parallel, TP and CP rank 0).
A job with "activations": true also writes OUT_DIR/NAME/activations_rankR.json: the bytes autograd saves for
backward in one forward of the next micro-batch (distinct storages, parameters excluded), counted by
saved-tensor hooks (no pipeline). A job with "fit": true instead trains with the trainer's own loop
(scaletrain.train.loop.fit: metrics, evaluation, checkpoints) into the run folder its overrides name (give an
absolute run.output_dir), as `scaletrain train` would, without a launch of its own; with "compile_probe": true
as well, parallel.compile=auto's probe runs as on a GPU and compiles the blocks after its timed steps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from scaletrain.config import load_config
from scaletrain.models.naming import plain_param_name
from scaletrain.monitor import configure_logging
from scaletrain.parallel import full_state_dict, init_distributed, shutdown_distributed
from scaletrain.train import Trainer


def saved_activation_bytes(trainer) -> int:
    """Bytes of distinct storages autograd saves during one forward + loss of the next micro-batch, without the
    parameters (FSDP's gathered ones included: they are the module's parameters while it runs)."""
    from scaletrain.train.step import loss_sum

    model, job = trainer.model.module, trainer.job
    seen: dict[int, int] = {}

    def pack(t):
        params = {p.untyped_storage().data_ptr() for p in model.parameters() if not hasattr(p, "device_mesh")}
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    mb = trainer.loader.next_step()[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_sum(job, trainer.task, mb)
    del loss
    return sum(seen.values())


def run_job(
    overrides: list[str], out: Path, rt, activations: bool = False, fit: bool = False, compile_probe: bool = False
) -> None:
    trainer = Trainer.build(load_config(None, overrides), rt)
    if fit:
        from scaletrain.parallel.compile import CompileProbe
        from scaletrain.train.loop import fit as fit_loop

        # compile_probe: parallel.compile=auto's probe as on a GPU, told compiling costs nothing (so it compiles)
        probe = CompileProbe(trainer.cfg.train.steps, 0, compile_s=0.0) if compile_probe else None
        fit_loop(trainer, compile_probe=probe)
        return
    results = (trainer.train_step(step) for step in range(1, trainer.cfg.train.steps + 1))
    losses = [trainer.mean_loss(r.loss_sum, r.count) for r in results]
    state = full_state_dict(trainer.model.module)  # a collective: every rank
    out.mkdir(parents=True, exist_ok=True)
    tp_rank = trainer.mesh["tp"].get_local_rank() if trainer.layout.tp > 1 else 0
    cp_rank = trainer.mesh["cp"].get_local_rank() if trainer.layout.cp > 1 else 0
    if trainer.job.dp_rank == 0 and tp_rank == 0 and cp_rank == 0:
        torch.save(state, out / f"state_rank{rt.rank}.pt")
    if rt.rank == 0:
        (out / "losses.json").write_text(json.dumps(losses))
        # which parameters the optimizer holds state for (LoRA: the adapters only), by their plain names
        names = {id(p): plain_param_name(n) for n, p in trainer.model.module.named_parameters()}
        held = sorted(names[id(p)] for p in trainer.job.optimizer.state if id(p) in names)
        (out / "optimizer_state.json").write_text(json.dumps(held))
    if activations:
        (out / f"activations_rank{rt.rank}.json").write_text(json.dumps(saved_activation_bytes(trainer)))


def main() -> None:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    rt = init_distributed("cpu")
    configure_logging(rt.rank, all_ranks=False)  # rank 0's log lines (the loop's, for "fit" jobs) on stderr
    try:
        for job in jobs:
            flags = [job.get(k, False) for k in ("activations", "fit", "compile_probe")]
            run_job(job["overrides"], out / job["name"], rt, *flags)
            torch.distributed.barrier()
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
