"""How a decoder's layers split into pipeline stages: one function the trainer builds stages from and the planner
counts parameters, activations and compute with, so a plan describes the stages the trainer will build.

The split is balanced by estimated cost, not layer count: the embedding joins the first stage and the output layer
plus loss the last, and with a large vocabulary the head alone can cost several blocks. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

# training cost of softmax + cross-entropy per logit (forward and backward), FLOP; an estimate: exp, sum, log,
# subtract in forward, softmax minus one-hot in backward
LOSS_FLOP_PER_LOGIT = 10.0


def layer_costs(args, seq_len: int) -> list[float]:
    """Training FLOPs per token of each transformer block, the embedding added to the first and the final norm,
    output layer and loss to the last (6·params + 12·dim·seq per block, the PaLM convention of flops_per_token)."""
    head_dim = args.dim // args.n_heads
    attn = 2 * args.dim * args.dim + 2 * args.dim * args.n_kv_heads * head_dim
    block = 6.0 * (attn + 3 * args.dim * args.ffn_dim) + 12.0 * args.dim * seq_len
    embedding = 2.0 * args.dim  # a lookup forward; a scatter-add of one row per token in backward
    head = 6.0 * args.dim * args.vocab_size + LOSS_FLOP_PER_LOGIT * args.vocab_size
    costs = [block] * args.n_layers
    costs[0] += embedding
    costs[-1] += head
    return costs


def _greedy_cuts(costs: Sequence[float], n_stages: int, limit: float) -> list[tuple[int, int]] | None:
    """Fill stages left to right up to `limit` each, cutting early where every later stage needs its one layer
    (so a feasible limit gives exactly n_stages stages); None when `limit` needs more than n_stages."""
    n, start, total = len(costs), 0, 0.0
    bounds: list[tuple[int, int]] = []
    limit *= 1.0 + 1e-12  # `limit` is a difference of prefix sums: allow the rounding of adding in another order
    for i, c in enumerate(costs):
        stages_left = n_stages - len(bounds)
        if i > start and (total + c > limit or n - i < stages_left):
            bounds.append((start, i))
            start, total = i, 0.0
        if c > limit:
            return None
        total += c
    bounds.append((start, n))
    return bounds if len(bounds) <= n_stages else None


def split_layers(costs: Sequence[float], n_stages: int, balance: str = "cost") -> list[tuple[int, int]]:
    """Contiguous [start, end) layer ranges, one per stage, each non-empty. balance='cost' minimises the cost of
    the most expensive stage (the pipeline's pace; later stages fill first on ties); 'layers' gives equal counts
    (earlier stages take the extra)."""
    n = len(costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"parallel.pp: {n_stages} pipeline stages need at least as many layers (the model has {n})")
    if balance == "layers":
        base, extra = divmod(n, n_stages)
        bounds, start = [], 0
        for s in range(n_stages):
            end = start + base + (1 if s < extra else 0)
            bounds.append((start, end))
            start = end
        return bounds
    costs = list(costs)
    # bisect, down to adjacent floats, the smallest stage-cost limit that greedy packing fits into n_stages stages
    # in both directions (they differ only by rounding): O(n log) where sorting all n² runs took minutes at 16k layers
    backwards = costs[::-1]

    def packs(limit: float) -> bool:
        return _greedy_cuts(costs, n_stages, limit) is not None and _greedy_cuts(backwards, n_stages, limit) is not None

    lo, hi = max(costs) * (1.0 - 1e-12), float(sum(costs)) * (1.0 + 1e-9)  # hi always packs
    if packs(lo):
        hi = lo
    while lo < (mid := (lo + hi) / 2) < hi:
        if packs(mid):
            hi = mid
        else:
            lo = mid
    # packed from the last stage backwards, so spare capacity lands on the first stages, which hold the most
    # micro-batches in flight under 1F1B-style schedules
    cuts = _greedy_cuts(backwards, n_stages, hi)
    assert cuts is not None  # hi is feasible: the bisection keeps it so
    return [(n - b, n - a) for a, b in reversed(cuts)]


def stage_costs(costs: Sequence[float], bounds: Sequence[tuple[int, int]]) -> list[float]:
    return [float(sum(costs[a:b])) for a, b in bounds]


def stages_of_rank(rank: int, pp: int, n_stages: int, v_shaped: bool) -> list[int]:
    """Stage indices a pipeline rank runs: rank, rank+pp, ... (looped), or rank and 2pp-1-rank (V shape)."""
    if v_shaped:
        return sorted({rank, n_stages - 1 - rank})
    return list(range(rank, n_stages, pp))


@lru_cache(maxsize=1024)
def rank_layers(
    args, seq_len: int, pp: int, stages_per_rank: int = 1, v_shaped: bool = False, balance: str = "cost"
) -> tuple[tuple[int, bool, bool], ...]:
    """For each pipeline rank: (transformer blocks it holds, holds the embedding, holds the output layer)."""
    n_stages = pp * stages_per_rank
    bounds = split_layers(layer_costs(args, seq_len), n_stages, balance) if pp > 1 else [(0, args.n_layers)]
    out = []
    for r in range(pp):
        ids = stages_of_rank(r, pp, n_stages, v_shaped)
        out.append((sum(bounds[s][1] - bounds[s][0] for s in ids), 0 in ids, n_stages - 1 in ids))
    return tuple(out)
