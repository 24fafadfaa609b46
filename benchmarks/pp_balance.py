"""Pipeline stage balance: the equal-layer-count split against the cost-balanced split for a model whose output
layer is expensive (a large vocabulary), by the cost model the trainer splits with and by measured forward +
backward time of each stage on this CPU (one thread, one process, median of --reps).

    python benchmarks/pp_balance.py [--vocab 8192] [--stages 2] [--seq-len 256] [--micro-batch 4] [--reps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from scaletrain.config import ModelConfig
from scaletrain.models import model_spec
from scaletrain.models.stages import split_layers, stage_costs


def measure(part, stage: int, n_stages: int, args, a) -> float:
    """Median seconds of one micro-batch's forward + backward through this stage."""
    tokens = torch.randint(0, args.vocab_size, (a.micro_batch, a.seq_len))
    times = []
    for _ in range(a.reps + 1):
        x = tokens if stage == 0 else torch.randn(a.micro_batch, a.seq_len, args.dim, requires_grad=True)
        start = time.perf_counter()
        out = part(x)
        if stage == n_stages - 1:
            F.cross_entropy(out.flatten(0, 1), tokens.flatten(), reduction="sum").backward()
        else:
            out.backward(torch.ones_like(out))
        times.append(time.perf_counter() - start)
        part.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    torch.set_num_threads(1)
    spec = model_spec(ModelConfig(name=a.model, vocab_size=a.vocab))
    args = spec.shape()
    model = spec.build("cpu")
    spec.init_weights(model, seed=0)
    costs = spec.layer_costs(a.seq_len)
    print(
        f"model {a.model} with vocabulary {a.vocab}: {args.n_layers} layers into {a.stages} stages; "
        f"micro-batch {a.micro_batch} x {a.seq_len} tokens, 1 thread"
    )
    print(
        f"{'split':<10}{'layers per stage':<22}{'model GFLOP/stage':<26}{'measured ms/stage':<24}"
        f"{'slowest (model, ms)'}"
    )
    for balance in ("layers", "cost"):
        bounds = split_layers(costs, a.stages, balance)
        model_cost = [c * a.micro_batch * a.seq_len / 1e9 for c in stage_costs(costs, bounds)]
        ms = [measure(spec.stage(model, s, a.stages, b), s, a.stages, args, a) * 1e3 for s, b in enumerate(bounds)]
        print(
            f"{balance:<10}{' '.join(f'{x}-{y - 1}' for x, y in bounds):<22}"
            f"{' '.join(f'{c:.2f}' for c in model_cost):<26}{' '.join(f'{t:.1f}' for t in ms):<24}"
            f"{max(model_cost):.2f}, {max(ms):.1f}"
        )


if __name__ == "__main__":
    main()
