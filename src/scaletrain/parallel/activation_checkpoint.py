"""Activation checkpointing: keep fewer activations from forward and recompute them in backward.

none: keep everything. full: every transformer block keeps only its input and is recomputed whole in backward
(about one extra forward of the blocks). selective/layer: every k-th block is checkpointed. selective/op: every
block keeps the outputs of its matmuls and attention (the expensive ops) and recomputes only the cheap pointwise
ones (norms, activations, rotary), the trade torchtitan's op-level selective mode makes.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from scaletrain.models.spec import ModelSpec
from scaletrain.parallel.blocks import block_container, block_items, set_block


def _saved_ops() -> set:
    names = [
        ("aten", "mm"),
        ("aten", "addmm"),
        ("aten", "bmm"),
        ("aten", "_scaled_dot_product_efficient_attention"),
        ("aten", "_scaled_dot_product_flash_attention"),
        ("aten", "_scaled_dot_product_flash_attention_for_cpu"),
        ("aten", "_scaled_dot_product_cudnn_attention"),
        # tensor-parallel collectives: recomputing them would repeat the communication
        ("_c10d_functional", "reduce_scatter_tensor"),
        ("_c10d_functional", "all_gather_into_tensor"),
        ("_c10d_functional", "all_reduce"),
    ]
    ops = set()
    for namespace, name in names:
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if packet is not None:
            ops.add(packet.default)
    return ops


def _op_policy(saved: set, ctx, func, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _wrap(block: nn.Module, op_level: bool) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if not op_level:
        return checkpoint_wrapper(block, preserve_rng_state=False)
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    policy = partial(_op_policy, _saved_ops())
    return checkpoint_wrapper(
        block, preserve_rng_state=False, context_fn=lambda: create_selective_checkpoint_contexts(policy)
    )


def apply_activation_checkpointing(
    model: nn.Module, mode: str, selective: str = "op", every: int = 2, spec: ModelSpec | None = None
) -> int:
    """Wrap the model's blocks (parallel/blocks.py) in place (mode: none / full / selective, selective: op /
    layer, every: checkpoint every k-th block for selective layer). Returns the number of blocks wrapped."""
    if mode == "none":
        return 0
    found = block_container(model, spec)
    if found is None:
        raise ValueError("parallel.activation_checkpoint: the model has no container of blocks to wrap")
    container = found[1]
    wrapped = 0
    for key, block in block_items(container):
        # count by the global layer index, so a pipeline stage checkpoints the same blocks as the whole model
        if mode == "selective" and selective == "layer" and (int(key) + 1) % every:
            continue
        set_block(container, key, _wrap(block, op_level=mode == "selective" and selective == "op"))
        wrapped += 1
    return wrapped
