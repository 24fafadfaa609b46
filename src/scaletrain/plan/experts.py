"""Expert parallelism in the planner: a mixture-of-experts model trained with FSDP2 over every rank and its routed
experts split over `ep` of them (parallel/expert.py, parallel/dims.py: dp_shard carved into (dp_shard / ep) x ep,
ep innermost). Per rank: parameters, gradients and AdamW states, the experts' sharded by ep and then by FSDP over
the dp_shard / ep ranks holding the same experts, everything else by FSDP over dp_shard, as the trainer keeps them
(fp32, dim 0 sharded: exact for the rank holding the most); per step: the dispatch + combine all-to-all of every
MoE layer (forward and backward) and the FSDP all-gathers and reduce-scatters, priced from the link figures the
dense planner uses (plan/comm.py), with the routing imbalance a parameter.

Parameter shapes come from the family's own model built on the meta device (no memory, no time), so the counts are
those of the tensors the trainer holds (tests/test_moe.py compares them with a run under EP 2).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from typing import Any, cast

import numpy as np

from scaletrain.hardware.cluster import Cluster
from scaletrain.models.spec import ModelSpec
from scaletrain.plan.comm import collective_seconds, group_placement
from scaletrain.plan.shapes import _shard_rows

COMPUTE_BYTES = 2  # bf16 hidden states through the all-to-alls and bf16 gathered weights (mixed precision)


@dataclass(frozen=True)
class ExpertParams:
    """Parameter elements and tensors of an MoE model (or of one pipeline rank's stage of it), split into the routed
    experts' and the rest."""

    expert_shapes: tuple[tuple[int, ...], ...]  # stacked expert weights, dim 0 the expert
    other_shapes: tuple[tuple[int, ...], ...]
    block_elements: tuple[tuple[int, int], ...]  # (expert, other) parameter elements of each block
    n_experts: int
    n_moe_layers: int
    top_k: int
    dim: int


def expert_params(spec: ModelSpec, pp: int = 1, seq_len: int | None = None) -> list[ExpertParams]:
    """The parameter shapes of `spec`'s model (built on meta) on each of `pp` pipeline ranks, its blocks cut as the
    trainer cuts them for `seq_len`-token samples (parallel/apply.py: split_layers of the spec's layer costs, the
    default balance); ValueError (one line) for a dense model or a cut that cannot be made."""
    from scaletrain.models.stages import split_layers

    n_experts = spec.n_experts
    if n_experts is None:
        raise ValueError(f"--ep: the {spec.model_name} model is dense (no experts); use --ep 1 or an MoE model")
    model = spec.build("meta")
    if pp == 1:
        return [_part_params(spec, model, n_experts)]
    spec.check_pp(pp)
    costs = spec.layer_costs(seq_len or spec.max_seq_len or 0)
    if pp > len(costs):
        raise ValueError(f"--pp: {pp} pipeline stages need at least as many blocks (the model has {len(costs)})")
    bounds = split_layers(costs, pp)
    return [_part_params(spec, spec.stage(model, s, pp, bounds[s]), n_experts) for s in range(pp)]


def _part_params(spec: ModelSpec, part: Any, n_experts: int) -> ExpertParams:
    layers = spec.expert_modules(part)
    expert_ids = {id(p) for layer in layers for p in cast(Any, layer).experts.parameters()}
    experts: list[tuple[int, ...]] = []
    other: list[tuple[int, ...]] = []
    for p in part.parameters():
        (experts if id(p) in expert_ids else other).append(tuple(p.shape))
    blocks = []
    container: Any = spec.blocks(part)  # a ModuleDict or a ModuleList (transformers' decoder layers)
    for block in container.values() if hasattr(container, "values") else container:
        sizes = [(id(p) in expert_ids, p.numel()) for p in block.parameters()]
        blocks.append((sum(n for e, n in sizes if e), sum(n for e, n in sizes if not e)))
    top_k = spec.experts_per_token
    assert top_k is not None, "a family with experts names its top-k"
    return ExpertParams(tuple(experts), tuple(other), tuple(blocks), n_experts, len(layers), top_k, spec.hidden_dim)


def check_ep(params: ExpertParams, ep: int, world: int) -> None:
    """ValueError (one line naming --ep) when ep cannot split these experts over `world` FSDP ranks (the GPUs of
    one pipeline stage)."""
    if ep < 1:
        raise ValueError(f"--ep: must be at least 1 (got {ep})")
    if params.n_experts % ep:
        raise ValueError(f"--ep: {ep} does not divide the {params.n_experts} experts; pick an ep that divides it")
    if world % ep:
        raise ValueError(
            f"--ep: {ep} does not divide the {world} data-parallel GPUs it is carved from; pick an ep that divides it"
        )


def rank_param_elements(params: ExpertParams, ep: int, dp_shard: int, fsdp: bool = True) -> dict[str, int]:
    """Parameter elements and tensors on the rank holding the most: experts (n_experts / ep of each stacked
    weight, dim 0 then sharded by FSDP2 over dp_shard / ep) and the rest (dim 0 sharded over dp_shard);
    fsdp=False: the experts split by ep, nothing sharded by FSDP (the whole gradients FSDP2 keeps in a pipeline)."""
    expert_parts, other_parts = (dp_shard // ep, dp_shard) if fsdp else (1, 1)
    experts = sum(_shard_rows(s[0] // ep, expert_parts) * math.prod(s[1:]) for s in params.expert_shapes if s)
    other = sum(_shard_rows(s[0], other_parts) * math.prod(s[1:]) for s in params.other_shapes if s)
    return {"experts": experts, "other": other, "tensors": len(params.expert_shapes) + len(params.other_shapes)}


def model_state_bytes(params: ExpertParams, ep: int, dp_shard: int, pipelined: bool = False) -> dict[str, float]:
    """Bytes of parameters, gradients and AdamW states on a rank, as the trainer keeps them: all fp32, exp_avg and
    exp_avg_sq plus one fp32 step counter per tensor; gradients sharded as the parameters, or whole (the rank's
    experts, every other tensor unsharded) in a pipeline of several micro-batches, where FSDP2 accumulates
    without reducing until the last backward (plan/memory.py holds_unsharded_grads)."""
    n = rank_param_elements(params, ep, dp_shard)
    numel = n["experts"] + n["other"]
    whole = rank_param_elements(params, ep, dp_shard, fsdp=False) if pipelined else n
    grads = 4.0 * (whole["experts"] + whole["other"])
    return {"parameters": 4.0 * numel, "gradients": grads, "optimizer states": 8.0 * numel + 4.0 * n["tensors"]}


def a2a_bytes_per_layer(tokens: int, top_k: int, dim: int, ep: int, element_bytes: int = COMPUTE_BYTES) -> float:
    """Bytes one rank sends to other ranks in one MoE layer's dispatch + combine (one forward) for `tokens` routed
    tokens under even routing: each (token, choice) row of `dim` elements leaves for its expert's rank and comes
    back, (ep - 1) / ep of them to another rank (the trainer's moe_a2a_bytes counts the same, summed over ranks)."""
    return 2.0 * tokens * top_k * dim * element_bytes * (ep - 1) / ep


def all_to_all_seconds(nbytes: float, ep: int, cluster: Cluster, imbalance: float = 1.0) -> float:
    """Seconds of one all_to_all_single over `ep` consecutive ranks where each rank sends `nbytes` in all (itself
    included, spread evenly over the ep ranks) and the busiest rank receives `imbalance` x its share: the bytes
    for ranks in its node go over the node's link, the rest over its NIC share, both at once."""
    if ep <= 1:
        return 0.0
    per_node, nodes = (float(x) for x in group_placement(ep, 1, cluster.gpus_per_node))
    moved = imbalance * nbytes
    intra = moved * (per_node - 1) / ep / cluster.intra_bw
    inter = moved * (ep - per_node) / ep / cluster.inter_bw_per_gpu if nodes > 1 else 0.0
    latency = cluster.intra_link.latency_s + (cluster.inter_link.latency_s if nodes > 1 else 0.0)
    return max(intra, inter) + latency


@dataclass(frozen=True)
class ExpertPlanRow:
    """One expert-parallel layout: pp pipeline stages, FSDP over the world / pp ranks of each, the experts split
    over `ep` of those."""

    ep: int
    pp: int
    expert_params_per_rank: int
    other_params_per_rank: int
    model_state_bytes: float  # parameters + gradients + AdamW states per rank, bytes
    # the largest block's weights FSDP2 all-gathers (compute dtype, this rank's experts only), twice: the next
    # block's are prefetched while one computes; under FSDP alone every expert of the layer is gathered
    gathered_bytes: float
    # bytes a rank sends to other ranks in one MoE layer's dispatch + combine, one forward of one micro-batch,
    # under even routing (the trainer's moe_a2a_bytes metric counts the same, summed over ranks and layers)
    a2a_bytes_per_layer: float
    a2a_seconds_per_step: float  # every MoE layer, forward and backward, every micro-batch
    fsdp_seconds_per_step: float  # all-gathers (forward, backward) and the gradients' reduce-scatter
    fits: bool  # model state and gathered weights within the GPU's memory (activations not counted)

    def to_dict(self) -> dict:
        return asdict(self)


def expert_plan_row(
    stages: list[ExpertParams],
    ep: int,
    cluster: Cluster,
    tokens_per_micro_batch: int,
    micro_batches: int,
    imbalance: float = 1.0,
) -> ExpertPlanRow:
    """Plan `len(stages)` pipeline stages (pp, outermost: parallel/dims.py) with FSDP over the world / pp GPUs of
    each and its experts split over `ep` of them; `tokens_per_micro_batch` tokens a rank routes per micro-batch,
    `micro_batches` per optimizer step. Each figure is the pipeline rank's that holds (or sends) the most."""
    world, pp = cluster.gpus, len(stages)
    if world % pp:
        raise ValueError(f"--pp: {pp} does not divide the {world} GPUs; pick a pp that divides them")
    dp = world // pp
    rows = [_stage_row(p, ep, dp, cluster, tokens_per_micro_batch, micro_batches, imbalance, pp > 1) for p in stages]
    held = max(rows, key=lambda r: r.model_state_bytes + r.gathered_bytes)
    return dataclasses.replace(
        held,
        pp=pp,
        a2a_bytes_per_layer=max(r.a2a_bytes_per_layer for r in rows),
        a2a_seconds_per_step=max(r.a2a_seconds_per_step for r in rows),
        fsdp_seconds_per_step=max(r.fsdp_seconds_per_step for r in rows),
        fits=all(r.fits for r in rows),
    )


def _stage_row(
    params: ExpertParams,
    ep: int,
    dp: int,
    cluster: Cluster,
    tokens_per_micro_batch: int,
    micro_batches: int,
    imbalance: float,
    pipelined: bool,
) -> ExpertPlanRow:
    check_ep(params, ep, dp)
    n = rank_param_elements(params, ep, dp)
    state = sum(model_state_bytes(params, ep, dp, pipelined and micro_batches > 1).values())
    gathered = 2.0 * COMPUTE_BYTES * max((e / ep + o for e, o in params.block_elements), default=0.0)
    # every (token, choice) row leaves once for dispatch and comes back once for combine, again in backward
    message = tokens_per_micro_batch * params.top_k * params.dim * COMPUTE_BYTES
    a2a = micro_batches * params.n_moe_layers * 4 * all_to_all_seconds(message, ep, cluster, imbalance)
    expert_whole = sum(math.prod(s) for s in params.expert_shapes) / ep * COMPUTE_BYTES
    other_whole = sum(math.prod(s) for s in params.other_shapes) * COMPUTE_BYTES
    fsdp = 0.0
    for whole, size, inner in ((expert_whole, dp // ep, ep), (other_whole, dp, 1)):
        # forward and backward all-gathers of the compute-dtype weights per micro-batch (FSDP2 reshards after
        # forward); the reduce-scatter of fp32 gradients per micro-batch, once per step inside a pipeline
        gathers = 2 * collective_seconds("all_gather", whole, size, inner, cluster)
        scatter = collective_seconds("reduce_scatter", 2 * whole, size, inner, cluster)
        fsdp += float(np.asarray(micro_batches * gathers + (1 if pipelined else micro_batches) * scatter))
    return ExpertPlanRow(
        ep=ep,
        pp=1,
        expert_params_per_rank=n["experts"],
        other_params_per_rank=n["other"],
        model_state_bytes=state,
        gathered_bytes=gathered,
        a2a_bytes_per_layer=a2a_bytes_per_layer(tokens_per_micro_batch, params.top_k, params.dim, ep),
        a2a_seconds_per_step=a2a,
        fsdp_seconds_per_step=fsdp,
        fits=state + gathered <= cluster.gpu.memory_bytes,
    )


def parse_ep(text: str) -> list[int]:
    """'1,8' -> [1, 8]; ValueError (one line naming --ep) for anything else."""
    try:
        degrees = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        degrees = []
    if not degrees:
        raise ValueError(f"--ep: expected whole expert-parallel degrees such as 1,8; got {text!r}")
    return degrees


def render_expert_plan(
    model: str, cluster: Cluster, seq_len: int, micro_batches: int, rows: list[ExpertPlanRow]
) -> str:
    """The rows as the table `scaletrain plan` prints for an MoE model."""
    gb = 1e9
    pp = rows[0].pp if rows else 1
    stages = (
        f"{pp} pipeline stages, FSDP over the {cluster.gpus // pp} GPUs of each" if pp > 1 else "FSDP over every GPU"
    )
    lines = [
        f"{model} on {cluster.gpus} x {cluster.gpu.name} ({cluster.gpus_per_node} per node): {stages}, experts "
        f"split over ep of them; {micro_batches} micro-batches of 1 {seq_len}-token sequence per step",
        "| ep | expert params/GPU | other params/GPU | model state GB | gathered GB | a2a MB/layer | a2a s/step "
        "| FSDP s/step | fits |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|:--:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.ep} | {r.expert_params_per_rank / 1e6:,.1f}M | {r.other_params_per_rank / 1e6:,.1f}M "
            f"| {r.model_state_bytes / gb:.2f} | {r.gathered_bytes / gb:.2f} | {r.a2a_bytes_per_layer / 1e6:.1f} "
            f"| {r.a2a_seconds_per_step:.3f} | {r.fsdp_seconds_per_step:.3f} | {'yes' if r.fits else 'no'} |"
        )
    lines.append(
        "model state: fp32 parameters, gradients and AdamW states, sharded (experts by ep, then FSDP); gathered: "
        "the largest block's bf16 weights, twice (prefetch); a2a: dispatch + combine sent to other ranks, "
        "one forward; activations not counted"
    )
    return "\n".join(lines)
