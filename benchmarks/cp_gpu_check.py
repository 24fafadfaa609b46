"""GPU check of context parallelism (needs CUDA; not run by the tests): the ring path (torch's context-parallel SDPA)
and the all-gather-KV path give the loss and gradients of the plain model (flash SDPA, is_causal), and how long
the attention of each takes.

    python benchmarks/cp_gpu_check.py                                   # one GPU: cp 1 (each path's wiring)
    torchrun --nproc-per-node 2 benchmarks/cp_gpu_check.py --seq 8192    # cp = the number of GPUs

Prints one JSON line on rank 0: per path the mean token loss, its difference from the reference, the largest
gradient difference, and the forward + backward time of the attention cores (CUDA events, median of --repeat).
Exit 1 when a path's loss differs by more than --tol.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--tol", type=float, default=2e-2, help="bf16 default; use 1e-4 with --dtype fp32")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("cp_gpu_check: no CUDA device; this check runs on GPUs only", file=sys.stderr)
        return 2
    from torch.distributed.device_mesh import init_device_mesh

    from scaletrain.models.llama import PRESETS, LlamaSpec
    from scaletrain.models.loss import token_loss_sum
    from scaletrain.parallel.context_parallel import apply_context_parallel

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    cp, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", local)
    mesh = init_device_mesh("cuda", (cp,), mesh_dim_names=("cp",))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32

    spec = LlamaSpec(dataclasses.replace(PRESETS["small"], max_seq_len=args.seq))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (args.batch, args.seq + 1), generator=gen).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def run(method: str | None) -> tuple[float, dict, float, float]:
        """(mean token loss, gradients, attention forward seconds, forward + backward seconds) of one path;
        method None: the plain model on the whole sequence (the same on every rank)."""
        model = spec.build("meta")
        model.to_empty(device=device)
        spec.init_weights(model, seed=0)
        x, y = inputs, targets
        if method is not None:
            ctx = apply_context_parallel(model, spec, mesh, device, method, args.seq)
            x, y = ctx.shard(inputs), ctx.shard(targets)
        cores = [m.core for m in model.modules() if hasattr(m, "core")]
        attn: list[float] = []
        step: list[float] = []
        for i in range(args.repeat + 1):
            model.zero_grad(set_to_none=True)
            marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in cores]
            hooks = [c.register_forward_pre_hook(lambda *_a, s=s: s.record()) for c, (s, _) in zip(cores, marks)]
            hooks += [c.register_forward_hook(lambda *_a, e=e: e.record()) for c, (_, e) in zip(cores, marks)]
            begin, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                loss = token_loss_sum(model(x), y)
            loss.backward()
            done.record()
            for h in hooks:
                h.remove()
            torch.cuda.synchronize()
            if i:  # the first pass warms up kernels and communicators
                attn.append(sum(s.elapsed_time(e) for s, e in marks) / 1e3)
                step.append(begin.elapsed_time(done) / 1e3)
        total = loss.detach().float()
        grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
        if method is not None:  # each cp rank holds the loss and gradient of its own tokens: they add up
            dist.all_reduce(total)
            for g in grads.values():
                dist.all_reduce(g)
        return total.item() / (args.batch * args.seq), grads, statistics.median(attn), statistics.median(step)

    ref_loss, ref_grads, ref_attn, ref_step = run(None)
    out: dict = {
        "cp": cp,
        "seq": args.seq,
        "dtype": args.dtype,
        "reference": {"loss": ref_loss, "attn_fwd_s": ref_attn, "fwd_bwd_s": ref_step},
    }
    ok = True
    for method in ("allgather", "ring"):
        loss, grads, t_attn, t_step = run(method)
        worst = max((grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads)
        out[method] = {
            "loss": loss,
            "loss_diff": abs(loss - ref_loss),
            "grad_diff": worst,
            "attn_fwd_s": t_attn,
            "fwd_bwd_s": t_step,
        }
        ok &= abs(loss - ref_loss) <= args.tol
    if rank == 0:
        print(json.dumps(out))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
