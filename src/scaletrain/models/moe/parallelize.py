"""The built-in mixture-of-experts decoder's tensor-parallel plan: Llama's (attention, dense blocks' MLPs, embedding,
output, sequence parallelism: models/llama/parallelize.py), with each MoE block's tokens split over the TP ranks.

A routed expert is small and picked per token, so it is not split by columns here (no expert tensor parallelism):
each TP rank instead routes and runs its share of the block's tokens, the sequence cut into tp pieces (torchtitan's
way with etp = 1). The block's input arrives replicated (or already sequence-sharded under sequence parallelism),
each rank takes its piece of the sequence, and the output is gathered back (or left sharded). The router and the
shared experts hold whole weights on every TP rank as Replicate DTensors fed sequence-sharded tokens, so their
gradients are partial per rank and DTensor sums them over TP; the routed experts' weights are reduced over the TP
ranks by FSDP2, whose expert mesh includes them (parallel/dims.py expert_fsdp_mesh). Every token is routed once,
as in one process: per-step losses match it (tests/test_moe.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scaletrain.models.moe.model import MoETransformer


def moe_tp_plan(model: MoETransformer, sequence_parallel: bool, loss_parallel: bool) -> dict:
    """{module path: ParallelStyle} for the built-in MoE decoder (and any pipeline stage of it)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput, SequenceParallel

    from scaletrain.models.llama.parallelize import llama_tp_plan
    from scaletrain.models.moe.model import MoEFeedForward

    plan = llama_tp_plan(model, sequence_parallel, loss_parallel)
    act = Shard(1) if sequence_parallel else Replicate()  # the residual stream between blocks
    for name, block in model.layers.items():
        moe = getattr(block, "feed_forward", None)
        if not isinstance(moe, MoEFeedForward):
            continue
        p = f"layers.{name}.feed_forward"
        for linear in ("w1", "w2", "w3"):  # the dense MLP's entries: an MoE block has none
            plan.pop(f"{p}.{linear}", None)
        plan[p] = PrepareModuleInputOutput(
            input_layouts=(act,),
            desired_input_layouts=(Shard(1),),  # this rank's piece of every sequence
            use_local_input=True,
            output_layouts=(Shard(1),),
            desired_output_layouts=(act,),
            use_local_output=True,
        )
        # inside the block the tokens are flat (batch x piece, dim): sharded on dim 0
        plan[f"{p}.router"] = SequenceParallel(sequence_dim=0, use_local_output=True)
        if moe.shared is not None:  # SequenceParallel lays out a leaf's own parameters: each linear of the MLP
            for linear in ("w1", "w2", "w3"):
                plan[f"{p}.shared.{linear}"] = SequenceParallel(sequence_dim=0, use_local_output=True)
    return plan
