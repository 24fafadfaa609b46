"""Per-rank peak memory of any layout the trainer runs, from the trainer's own layout code on the meta device: torch's
fake process group stands for the other ranks (collectives return at once, nothing is sent), `apply_parallelism`
lays the job's model out on `torch.device("meta")` (shapes only, no memory), and one warm-up step and one measured
step (forward, backward and AdamW's step through train/step.py and Job) run under torch's MemTracker, which
counts the bytes each meta storage would hold. No formulas: what TP splits, which blocks FSDP2 gathers and what
autograd keeps are the trainer's and the model's own. (FakeTensorMode cannot be used: `to_empty` cannot swap a
DTensor parameter its converter holds a weak reference to.)

Measured against the trainer on CPU ranks in tests/test_plan_peak_memory.py. Ops that read values the meta device
lacks (a Hugging Face model's .item()) fail: ValueError in one line. The built-in MoE routes uniformly on meta
tensors (models/moe/model.py shape_only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scaletrain.config.schema import JobConfig


def _meta_batch(task_name: str, spec: Any, layout: Any, seq_len: int):
    import torch

    mb = layout.micro_batch
    if task_name == "image-classification":
        from scaletrain.data.image_loader import ImageBatch

        size, channels = int(spec.image_size), int(getattr(spec, "num_channels", 3))
        pixels = torch.zeros((mb, channels, size, size), device="meta")
        return ImageBatch(pixels, torch.zeros((mb,), dtype=torch.int64, device="meta"))
    if task_name == "causal-lm":
        from scaletrain.data.loader import Batch

        tokens = torch.zeros((mb, seq_len), dtype=torch.int64, device="meta")
        return Batch(tokens, tokens.clone())
    raise ValueError(f"task.name: a layout trace knows no meta batch of {task_name!r}; use causal-lm or "
                     f"image-classification")  # fmt: skip


def _unpacked_hf_masks():
    """A context in which transformers' mask builder takes a meta batch as unpacked: it reads whether position_ids
    restart (`.all()` on a tensor, a value meta lacks); the layout trace's batches carry no document positions, so
    the answer is the real run's: no packed sequences, the plain causal mask."""
    import contextlib
    from unittest import mock

    try:
        from transformers import masking_utils
    except ImportError:
        return contextlib.nullcontext()
    real = masking_utils.find_packed_sequence_indices

    def on_meta(position_ids):
        return None if position_ids.device.type == "meta" else real(position_ids)

    return mock.patch.object(masking_utils, "find_packed_sequence_indices", on_meta)


def layout_peak(cfg: JobConfig, world_size: int, rank: int = 0) -> dict[str, int]:
    """Peak bytes on `rank` of step 2 of the job on `world_size` ranks: {"total": bytes, category: bytes} as
    train/peak_memory.py reports a real run's. Needs no process group of its own (refused where one is running)."""
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from scaletrain.parallel import ParallelPlan, Runtime, apply_parallelism, build_mesh
    from scaletrain.resolve import resolve_job
    from scaletrain.tasks import task_for
    from scaletrain.train.job import Job
    from scaletrain.train.optim import build_optimizer
    from scaletrain.train.step import forward_backward

    if dist.is_initialized():
        raise ValueError("a layout trace runs on its own fake process group; call it outside a distributed job")
    resolved = resolve_job(cfg, world_size)
    layout, spec = resolved.layout, resolved.spec
    if cfg.lora.rank:
        raise ValueError("lora.rank: a layout trace does not add adapters yet; plan without --lora-rank")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        mesh = build_mesh(layout, "cpu")
        meta = torch.device("meta")
        plan = ParallelPlan(layout, cfg.parallel, cfg.precision, spec, seq_len=cfg.data.seq_len)
        model = apply_parallelism(spec.build("meta"), plan, mesh, meta, lambda m: None)
        optimizer = build_optimizer(model.module, cfg.train)
        job = Job.for_model(model, optimizer, Runtime(rank, rank, world_size, meta, "fake"), cfg.train.grad_clip)
        task = task_for(cfg.task)
        batches = [_meta_batch(task.name, spec, layout, cfg.data.seq_len) for _ in range(layout.accumulation)]
        tracker = MemTracker()
        tracker.track_external(model.module, optimizer)
        try:
            with _unpacked_hf_masks():
                for step in (1, 2):
                    if step == 2:  # entering again starts the peak from what is live now
                        tracker.reset_mod_stats()
                        tracker.track_external(model.module, optimizer)
                    with tracker:
                        forward_backward(job, task, batches, 1.0)
                        # Job.step's gradient norm uses foreach kernels meta tensors lack: the update and zero_grad
                        # alone (the norm's few scalars are not counted)
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
        except (NotImplementedError, RuntimeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(
                f"model.name: the layout trace of {spec.model_name} failed on the meta device ({first})"
            ) from e
        peak = tracker.get_tracker_snapshot("peak")
    finally:
        dist.destroy_process_group()
    out = {"total": 0}
    for device_snap in peak.values():  # meta storages, and the few scalars made on the CPU (AdamW's step counts)
        for key, value in device_snap.items():
            name = str(getattr(key, "value", key))
            out["total" if name == "Total" else name] = out.get("total" if name == "Total" else name, 0) + int(value)
    return out
