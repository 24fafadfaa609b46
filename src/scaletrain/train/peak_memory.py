"""Measured peak memory of one training step on this rank, without torch.cuda: torch's MemTracker (a dispatch mode
that follows every tensor storage through weak references, deduplicated by storage, DTensors by their local
shards) watches the trainer being built and one warm-up step, then reports the largest sum of live bytes during
the next step (the steady state: AdamW's states exist, the last step's gradients are freed).

The planner's per-rank memory lines are compared with it (tests/test_plan_peak_memory.py, docs/planner.md
"Measured peak memory"). What it counts: every storage an ATen operator allocates, parameters and buffers
included; not what C++ code allocates without the dispatcher (gloo's own buffers) nor allocator slack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scaletrain.config.schema import JobConfig
    from scaletrain.parallel import Runtime
    from scaletrain.train import Trainer

# MemTracker's categories, as this module reports them
CATEGORIES = ("Parameter", "Buffer", "Gradient", "Activation", "Temp", "Optstate", "Other")


def measure_step_peak(cfg: JobConfig, rt: Runtime) -> tuple[Trainer, dict[str, int]]:
    """Build the job's trainer and take steps 1 and 2; returns the trainer and step 2's peak bytes on this rank:
    {"total": bytes, category: bytes at that moment, ...} (CATEGORIES)."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from scaletrain.train import Trainer

    tracker = _tracker(MemTracker)()
    with tracker:  # from the first allocation: DDP's buckets and FSDP2's buffers are made while the model is laid out
        trainer = Trainer.build(cfg, rt)
        trainer.train_step(1)
    # parameters, gradients and optimizer states by name from here; module stats are per iteration
    tracker.reset_mod_stats()
    tracker.track_external(trainer.model.module, trainer.job.optimizer)
    with tracker:  # entering again starts the peak from what is live now
        trainer.train_step(2)
    peak = tracker.get_tracker_snapshot("peak").get(torch.device("cpu"), {})
    out = {"total": 0}
    for key, value in peak.items():
        name = getattr(key, "value", key)
        if name == "Total":
            out["total"] = int(value)
        else:
            out[str(name)] = int(value)
    return trainer, out


class _NoHook:
    def remove(self) -> None:
        pass


def _tracker(base):
    """MemTracker that leaves frozen parameters (a VLM's vision tower, a LoRA base, a meta model's check under
    no_grad) without the gradient hook it registers on every parameter of a module it enters: torch 2.13 refuses a
    hook on a tensor that does not require gradients ("cannot register a hook on a tensor that doesn't require
    gradient"). They get placeholder handles, which it takes for hooks already there; a frozen parameter never has
    a gradient to count."""

    class Tracker(base):
        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
            for param in module.parameters():
                if not param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                    self._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    return Tracker
