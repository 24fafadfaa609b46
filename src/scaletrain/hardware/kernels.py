"""The work `scaletrain bench` times (hardware/bench.py): GEMM shapes around a size, copies, causal attention
forward + backward, a step of the built-in `tiny` model, and the flat-tensor collectives; with the sizes each is
measured at."""

from __future__ import annotations

import torch

KIB, MIB, GIB = 2**10, 2**20, 2**30
# tensor sizes the copy curve is measured at: from cache-resident to well past the last-level cache (CPU), from
# launch-bound to streaming (GPU)
COPY_BYTES = {"cpu": (64 * KIB, 1 * MIB, 16 * MIB, 64 * MIB), "cuda": (1 * MIB, 16 * MIB, 256 * MIB, GIB)}
COLLECTIVE_BYTES = (4 * KIB, 64 * KIB, 1 * MIB, 16 * MIB, 256 * MIB)  # up to the --size-mb message

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")  # timed between the ranks at each message size

# causal attention (scaled_dot_product_attention, forward + backward) measured at these (sequence length, head dim)
# points: one sequence of ATTENTION_HEADS heads on a CPU, four on a GPU
ATTENTION_POINTS = {
    "cpu": ((128, 32), (128, 128), (512, 32), (512, 128), (1024, 32)),
    "cuda": tuple((s, d) for s in (512, 2048, 8192) for d in (64, 128)),
}
ATTENTION_HEADS = 4
# the step measured op by op on a CPU (step_profile): the built-in `tiny` model on STEP_BATCH x STEP_SEQ tokens, a
# training step's activations (a few MB per tensor), STEP_REPEATS times after a warm-up
STEP_BATCH, STEP_SEQ, STEP_REPEATS = 4, 256, 3


def matmul_shapes(n: int) -> list[tuple[int, int, int]]:
    """(m, n, k) shapes measured around a large square size `n`: squares down to n/16, and skinny GEMMs (many
    tokens through a narrow layer, attention scores with a short head dim) whose intensity is low."""
    d = lambda f: max(1, n // f)  # noqa: E731
    shapes = [(n, n, n), (d(2),) * 3, (d(4),) * 3, (d(16),) * 3, (4 * n, d(8), d(8)), (4 * n, d(32), d(32))]
    # n x n/8 x n/8 and n/2 x n/2 x n/8: working sets between the squares', where a CPU's rate falls off its cache
    shapes += [(d(4), d(4), d(32)), (n, n, d(32)), (n, d(8), d(8)), (d(2), d(2), d(8))]
    return list(dict.fromkeys(shapes))


def collective_functions():
    """(all-gather, reduce-scatter) into/from one flat tensor: torch 2.13 renamed all_gather_into_tensor and
    reduce_scatter_tensor (deprecated there) to all_gather_single and reduce_scatter_single."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather, getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def attention_flops(seq: int, head_dim: int, heads: int = 1) -> float:
    """FLOPs of causal attention's forward + backward, by the planner's convention (plan/efficiency.py): forward
    QK^T and AV on half the s x s scores, 2 s^2 d per head; backward twice the forward."""
    return 3.0 * 2.0 * seq * seq * head_dim * heads


def attention_step(seq: int, head_dim: int, batch: int, dtype: torch.dtype, device: str):
    """Forward + backward of causal scaled_dot_product_attention on `batch` sequences of ATTENTION_HEADS heads."""
    import torch.nn.functional as F

    q, k, v = (
        torch.randn(batch, ATTENTION_HEADS, seq, head_dim, dtype=dtype, device=device, requires_grad=True)
        for _ in range(3)
    )
    grad = torch.randn(batch, ATTENTION_HEADS, seq, head_dim, dtype=dtype, device=device)

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
        q.grad = k.grad = v.grad = None

    return step


def tiny_model_step(device: str = "cpu", batch: int = 1, seq: int = 8):
    """Forward + backward of the built-in `tiny` model on batch x seq tokens. On 8 tokens the kernels are too small
    to matter: its seconds / its dispatched ops (op_profile.count_dispatched_ops) is the host time per dispatched op
    (the planner's OPS_PER_BLOCK count)."""
    import torch.nn.functional as F

    from scaletrain.models import preset_spec

    spec = preset_spec("tiny")
    model = spec.build("meta").to_empty(device=device)
    spec.init_weights(model, seed=0)
    tokens = torch.randint(0, spec.args.vocab_size, (batch, seq), device=device)

    def step() -> None:
        logits = model(tokens)
        F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten(), reduction="sum").backward()
        model.zero_grad(set_to_none=True)

    return step
