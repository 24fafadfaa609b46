"""Pipeline parallelism on torch.distributed.pipelining: the layers are split into stages at block boundaries,
each rank runs its stage(s), and a schedule (GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble,
DualPipeV) orders the micro-batches' forward and backward passes.

The split (models/stages.py, shared with the planner) is balanced by estimated cost, not layer count. Stage modules
are pruned copies of the whole model cut by its spec (ModelSpec.stage: same parameter names), so weights initialise
from the same numbers as one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from scaletrain.config.schedules import pipeline_schedule
from scaletrain.models.stages import stages_of_rank as _stages_of_rank


def stages_of_rank(rank: int, pp: int, n_stages: int, schedule: str) -> list[int]:
    """Stage indices a pipeline rank runs: rank, rank+pp, ... (looped), or rank and 2pp-1-rank (V shape)."""
    return _stages_of_rank(rank, pp, n_stages, pipeline_schedule(schedule).v_shaped)


def bubble_fraction(
    pipeline_order: dict, n_stages: int, forward: float = 1.0, backward_input: float = 1.0, backward_weight: float = 1.0
) -> float | None:
    """Idle share of the pipeline ranks' time over one step of a torch schedule's action table, replayed with
    equal-cost stages (forward F, input-gradient I and weight-gradient W costs; a full backward is I + W) and
    free communication. None if the table cannot be replayed."""
    cost = {"F": forward, "I": backward_input, "W": backward_weight, "B": backward_input + backward_weight}

    def leaves(action):
        if action.sub_actions:
            for sub in action.sub_actions:
                yield from leaves(sub)
        elif action.computation_type.value in cost:
            yield action

    queues = {r: [a for act in acts if act is not None for a in leaves(act)] for r, acts in pipeline_order.items()}
    done: dict[tuple[str, int, int], float] = {}
    clock = {r: 0.0 for r in queues}
    busy = {r: 0.0 for r in queues}
    pos = {r: 0 for r in queues}

    def ready_at(a) -> float | None:
        kind, s, m = a.computation_type.value, a.stage_index, a.microbatch_index
        needs = []
        if kind == "F" and s > 0:
            needs.append([("F", s - 1, m)])
        if kind in ("B", "I"):
            needs.append([("F", s, m)])
            if s < n_stages - 1:
                needs.append([("B", s + 1, m), ("I", s + 1, m)])
        if kind == "W":
            needs.append([("I", s, m), ("B", s, m)])
        t = 0.0
        for options in needs:
            times = [done[k] for k in options if k in done]
            if not times:
                return None
            t = max(t, min(times))
        return t

    progressed = True
    while progressed:
        progressed = False
        for r, queue in queues.items():
            while pos[r] < len(queue):
                a = queue[pos[r]]
                t = ready_at(a)
                if t is None:
                    break
                start = max(clock[r], t)
                c = cost[a.computation_type.value]
                clock[r] = start + c
                busy[r] += c
                done[(a.computation_type.value, a.stage_index, a.microbatch_index)] = clock[r]
                pos[r] += 1
                progressed = True
    if any(pos[r] < len(q) for r, q in queues.items()):
        return None
    span = max(clock.values())
    return 1.0 - sum(busy.values()) / (len(queues) * span) if span else 0.0


@contextlib.contextmanager
def _forward_only_actions(schedule, name: str):
    """torch 2.13 runs a V schedule's backward actions in eval() too and fails handing a gradient between the two
    stages of one rank; replay only its forward and communication-of-forward actions instead. Dropping actions
    only drops waits, so the remaining order cannot deadlock."""
    table = getattr(schedule, "pipeline_order_with_comms", None)
    if not pipeline_schedule(name).v_shaped or not table:
        yield
        return
    keep = {"F", "SEND_F", "RECV_F", "UNSHARD", "RESHARD"}

    def forward_part(actions):
        for a in actions:
            for leaf in (a.sub_actions or (a,)) if a is not None else ():  # DualPipeV overlaps an F with a B
                if leaf.computation_type.value in keep:
                    yield leaf

    schedule.pipeline_order_with_comms = {rank: list(forward_part(actions)) for rank, actions in table.items()}
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = table


LossSum = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (outputs, targets) -> summed loss: the task's


class Pipeline:
    """This rank's stages under one schedule. step() runs a whole optimizer step's forward and backward over the
    micro-batches; the loss (the task's summed loss × loss_scale per micro-batch) is computed on the last stage,
    which returns the summed loss; other ranks return zero."""

    def __init__(
        self,
        stages: list,
        schedule,
        n_stages: int,
        n_microbatches: int,
        schedule_name: str,
        bounds: list[tuple[int, int]],
    ):
        self.stages = stages
        self.schedule = schedule
        self.n_stages = n_stages
        self.n_microbatches = n_microbatches
        self.schedule_name = schedule_name
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)
        self.loss_scale = 1.0
        self.loss_sum: LossSum | None = None  # the running step's loss (the task's), set by step() / evaluate()
        self.bounds = bounds  # [start, end) block range of every stage
        self.shared: SharedCopies | None = None  # parameters tied across stages (set by apply_parallelism)
        self._losses: list[torch.Tensor] = []
        order = getattr(schedule, "pipeline_order", None)
        self.bubble = bubble_fraction(order, n_stages, 1.0, 1.0, 1.0) if order else None
        if self.bubble is None and pipeline_schedule(schedule_name).placement == "single":
            # torch 2.13's 1F1B action table (kept for visualisation) skips a micro-batch on the last rank; with
            # equal stages its bubble is GPipe's (p-1)/(m+p-1) (Narayanan et al. 2021, sec. 2.2)
            self.bubble = (n_stages - 1) / (n_microbatches + n_stages - 1)

    def loss_fn(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        assert self.loss_sum is not None, "the schedule runs the loss only inside step() or evaluate()"
        loss = self.loss_sum(outputs, targets)
        self._losses.append(loss.detach())
        return loss * self.loss_scale

    def _run(
        self, inputs: tuple[torch.Tensor, ...], targets: torch.Tensor, train: bool, kwargs: dict | None = None
    ) -> torch.Tensor:
        self._losses = []
        args = inputs if self.has_first else ()
        target = targets if self.has_last else None
        kwargs = kwargs or {}  # every stage's: torch splits them into micro-batches and passes them to each stage
        if train:
            self.schedule.step(
                *args, target=target, losses=[] if self.has_last else None, return_outputs=False, **kwargs
            )
        else:
            with _forward_only_actions(self.schedule, self.schedule_name):
                self.schedule.eval(*args, target=target, losses=[] if self.has_last else None, **kwargs)
        if not self.has_last:
            return torch.zeros((), device=targets.device)
        # the first step also runs the loss once on shape-inference tensors: keep the micro-batches' own
        return torch.stack(self._losses[-self.n_microbatches :]).sum()

    def step(
        self,
        inputs: tuple[torch.Tensor, ...],
        targets: torch.Tensor,
        loss_scale: float,
        loss_sum: LossSum,
        kwargs: dict | None = None,
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns this rank's summed loss (0 off the last stage).
        inputs (the first stage's arguments) and targets: (b, ...) of this data-parallel rank, split into
        n_microbatches; kwargs: (b, ...) keyword arguments of every stage's forward, split the same way;
        loss_sum(outputs, targets): the task's loss of one micro-batch, run on the last stage."""
        self.loss_scale, self.loss_sum = loss_scale, loss_sum
        return self._run(inputs, targets, True, kwargs)

    def evaluate(
        self, inputs: tuple[torch.Tensor, ...], targets: torch.Tensor, loss_sum: LossSum, kwargs: dict | None = None
    ) -> torch.Tensor:
        """Forward only; summed loss on the last stage, 0 elsewhere."""
        self.loss_scale, self.loss_sum = 1.0, loss_sum
        return self._run(inputs, targets, False, kwargs)

    def describe(self) -> str:
        bubble = f", bubble {self.bubble:.1%} (equal-cost stages, F:B = 1:2)" if self.bubble is not None else ""
        layers = f" (layers {' '.join(f'{a}-{b - 1}' for a, b in self.bounds)})"
        return (
            f"pipeline {self.schedule_name}: {self.n_stages} stages{layers}, {self.n_microbatches} "
            f"micro-batches{bubble}"
        )


class SharedCopies:
    """Copies of one parameter held by several stages (a tied embedding on the first stage, output layer on the
    last): they start equal and stay equal because, after every backward, each copy's gradient becomes their sum,
    over the ranks of `group` (one pipeline's ranks holding a copy; None when this rank holds all of them).
    Only the first stage's copy counts in the global gradient norm."""

    def __init__(self, copies: list[nn.Parameter], uncounted: list[nn.Parameter], group):
        self.copies = copies
        self.uncounted = {id(p) for p in uncounted}
        self.group = group

    def reduce_grads(self) -> None:
        import torch.distributed as dist

        if not self.copies:
            return
        with torch.no_grad():
            grads = []
            for p in self.copies:
                if p.grad is None:  # a copy this step did not reach: contributes zero
                    p.grad = torch.zeros_like(p)
                g = p.grad
                grads.append(g.to_local() if hasattr(g, "to_local") else g)
            total = grads[0].clone() if len(grads) > 1 else grads[0]
            for g in grads[1:]:
                total.add_(g)
            if self.group is not None:
                dist.all_reduce(total, group=self.group)
            for g in grads:
                if g is not total:
                    g.copy_(total)


def shared_copies(
    parts: list[nn.Module], stage_ids: list[int], names: tuple[str, ...], n_stages: int, mesh, schedule: str
) -> SharedCopies:
    """This rank's copies of the parameters named `names` (plain names) that the first and the last stage both
    hold, and a group per pipeline of the ranks running those two stages (every rank creates every group, in the
    same order, as new_group requires)."""
    import torch.distributed as dist

    from scaletrain.models.naming import plain_param_name

    copies, uncounted = [], []
    for part, sid in zip(parts, stage_ids):
        for name, p in part.named_parameters():
            if plain_param_name(name) in names:
                copies.append(p)
                if sid != 0:
                    uncounted.append(p)
    pp = mesh["pp"].size()
    owners = sorted({r for r in range(pp) if {0, n_stages - 1} & set(stages_of_rank(r, pp, n_stages, schedule))})
    group = None
    if len(owners) > 1:
        dim = list(mesh.mesh_dim_names).index("pp")
        pipelines = mesh.mesh.movedim(dim, -1).reshape(-1, pp).tolist()
        me = dist.get_rank()
        for ranks in pipelines:
            g = dist.new_group([ranks[r] for r in owners])
            if me in ranks:
                group = g
    return SharedCopies(copies, uncounted, group)


class PipelinedModel(nn.ModuleList):
    """This rank's pipeline stage modules (each a pruned copy of the model, possibly wrapped by TP/FSDP/DDP); a
    checkpoint names their parameters `<position>.<plain name>`."""

    def __init__(self, parts: list[nn.Module], stage_ids: list[int]):
        super().__init__(parts)
        self.stage_ids = stage_ids


def build_pipeline(
    parts: list[nn.Module],
    stage_ids: list[int],
    n_stages: int,
    pp_mesh,
    device: torch.device,
    schedule_name: str,
    n_microbatches: int,
    bounds: list[tuple[int, int]],
) -> Pipeline:
    """PipelineStages for this rank's parts and the named schedule over them (gradients not rescaled: the loss
    already carries the step's normalisation)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class
    from torch.nn.parallel import DistributedDataParallel

    group = pp_mesh.get_group()
    holder: dict = {}

    def loss_fn(logits, targets):
        return holder["pipeline"].loss_fn(logits, targets)

    class Stage(PipelineStage):
        def _compute_outputs(self, *args, module, **kwargs):
            # shape inference runs one real forward; under DDP outside no_sync() it would arm the gradient hooks
            # and the next accumulating backward would register every parameter twice (reducer assert)
            # its buffers are put back after it: what a forward counts in them (an MoE layer's expert load) must
            # be the micro-batches' own
            kept = [(b, b.detach().clone()) for b in module.buffers()]
            if isinstance(module, DistributedDataParallel):
                with module.no_sync():
                    out = module(*args, **kwargs)
            else:
                out = module(*args, **kwargs)
            with torch.no_grad():
                for buffer, value in kept:
                    if not torch.equal(buffer, value):  # unchanged ones (rotary tables) are in its graph: untouched
                        buffer.copy_(value)
            return out

    stages = [Stage(part, sid, n_stages, device, group=group) for part, sid in zip(parts, stage_ids)]
    cls = get_schedule_class(schedule_name)
    if pipeline_schedule(schedule_name).placement == "single":  # PipelineScheduleSingle takes one stage
        schedule = cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
    else:
        schedule = cls(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    pipeline = Pipeline(stages, schedule, n_stages, n_microbatches, schedule_name, bounds)
    holder["pipeline"] = pipeline
    return pipeline
