"""The built-in Llama's tensor-parallel plan (Megatron-style, on DTensor), with sequence parallelism.

Attention q/k/v and MLP up/gate projections are split by output column, attention output and MLP down projections
by input row. The embedding is split along the hidden dim (a vocabulary split would get a full-size gradient back on
every rank), the output layer by vocabulary column; with loss parallelism its logits stay vocabulary-sharded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scaletrain.models.llama.model import Llama


def llama_tp_plan(model: Llama, sequence_parallel: bool, loss_parallel: bool) -> dict:
    """{module path: ParallelStyle} for the built-in Llama (and any pipeline stage of it)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    sp = sequence_parallel
    act = Shard(1) if sp else Replicate()  # layout of the residual stream between blocks
    plan: dict = {}
    if model.tok_embeddings is not None:
        # sharded on the hidden dim, not the vocabulary: torch 2.13 returns a vocabulary-sharded (RowwiseParallel)
        # embedding's gradient as a full Replicate tensor on every rank (tests/test_plan_distributed.py)
        plan["tok_embeddings"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=act)
    if model.norm is not None and sp:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=act,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    for name in model.layers:
        p = f"layers.{name}."
        plan.update(
            {
                p + "attention.wq": ColwiseParallel(),
                p + "attention.wk": ColwiseParallel(),
                p + "attention.wv": ColwiseParallel(),
                p + "attention.wo": RowwiseParallel(output_layouts=act),
                p + "feed_forward.w1": ColwiseParallel(),
                p + "feed_forward.w3": ColwiseParallel(),
                p + "feed_forward.w2": RowwiseParallel(output_layouts=act),
            }
        )
        if sp:
            plan.update(
                {
                    p + "attention_norm": SequenceParallel(),
                    p + "ffn_norm": SequenceParallel(),
                    # the rotary tables (2nd, 3rd inputs) are plain tensors every rank holds whole
                    p + "attention": PrepareModuleInput(
                        input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                    ),
                    p + "feed_forward": PrepareModuleInput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                    ),
                }
            )
    return plan
