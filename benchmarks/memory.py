"""Memory options side by side: FSDP2 on N local ranks (gloo on CPU, NCCL on GPUs), the trainer's own Job,
forward_backward and optimizer step, each variant in its own launch (fresh processes: freed pages of one variant
must not serve the next one's peak):

    baseline     sharded accumulation (the default), lean activations (the default), no offload
    unsharded    parallel.fsdp_accumulate=unsharded (whole fp32 gradients until the last micro-batch)
    offload      parallel.cpu_offload=true (FSDP2 CPUOffloadPolicy)
    plain-act    the Llama block without its activation reductions and the loss unchunked

Per rank: the measured peak during the steps (GPU: max_memory_allocated; CPU: peak RSS over the RSS before the model
was built, VmHWM reset through /proc/self/clear_refs) next to the planner's prediction for the same layout, and the
median step time as a ratio to the baseline's. On a CPU, RSS also counts the allocator's cached and freed pages
and first-use buffers (gloo, autograd threads), so it is an upper bound; the planner's CPU prediction has no CUDA
context or NCCL lines, and for offload it adds the host-side shards (on a CPU host they are the same memory).

    python benchmarks/memory.py [--nproc 2] [--dim 512] [--layers 4] [--vocab 8192] [--seq-len 256]
                                [--accumulation 4] [--steps 3] [--markdown BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import statistics
import time
from pathlib import Path

import torch

VARIANTS = ("baseline", "unsharded", "offload", "plain-act")
FOOTER = (
    "On CPU ranks peak RSS is an upper bound: it also holds what the allocator keeps after frees and every "
    "temporary, which the planner's lines do not model one by one; differences of a few tens of MB between "
    "variants are within that noise here. The exact checks are the tests: tensor bytes of model states "
    "(tests/test_plan_distributed.py) and saved activations (tests/test_plan_formulas.py) against the planner. "
    "Step times come from 2 CPU cores shared with other jobs: read the ratios, not the seconds. On a CPU host "
    "offload only adds copies (host and device are the same memory)."
)


def _rss_bytes(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak(device: torch.device) -> bool:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _peak(device: torch.device, base: int) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _rss_bytes("VmHWM") - base


def _shape(args, dim: int, layers: int, vocab: int):
    from scaletrain.models.llama.args import LlamaArgs

    return LlamaArgs(
        dim=dim,
        n_layers=layers,
        n_heads=max(1, dim // 64),
        n_kv_heads=max(1, dim // 256),
        ffn_dim=int(dim * 2.75) // 64 * 64,
        vocab_size=vocab,
        max_seq_len=args.seq_len,
    )


def _train(shape, variant: str, args, rank: int, world: int, device: torch.device, steps: int) -> list[float]:
    """Build the variant's FSDP2 model, optimizer and Job, run a warm-up step and `steps` more; step seconds.
    The peak counter is reset after the warm-up (lazy FSDP init, optimizer states created)."""
    from scaletrain.config.schema import ParallelConfig, PrecisionConfig, TrainConfig
    from scaletrain.data.loader import Batch
    from scaletrain.models.llama.spec import LlamaSpec
    from scaletrain.config.layout import Layout
    from scaletrain.parallel.apply import ParallelPlan, apply_parallelism
    from scaletrain.parallel.dims import build_mesh
    from scaletrain.tasks.causal_lm import CausalLM
    from scaletrain.train import step as train_step

    class _UnchunkedLM(CausalLM):
        """The loss without chunks: whole fp32 logits and log-softmax kept for backward."""

        def loss_sum(self, outputs, targets):
            from scaletrain.models.loss import token_loss_sum

            return token_loss_sum(outputs, targets, chunked=False)

    from scaletrain.train.job import Job
    from scaletrain.train.optim import build_optimizer

    lean = variant != "plain-act"
    spec = LlamaSpec(shape)
    layout = Layout(1, world, 1, 1, precision=args.dtype)
    mesh = build_mesh(layout, device.type)
    pcfg = ParallelConfig(
        dp_shard=world,
        fsdp_accumulate="unsharded" if variant == "unsharded" else "sharded",
        cpu_offload=variant == "offload",
    )
    model = spec.build("meta")
    for module in model.modules():  # the Llama's attention and SwiGLU read this flag
        if hasattr(module, "lean_activations"):
            module.lean_activations = lean
    plan = ParallelPlan(layout, pcfg, PrecisionConfig(dtype=args.dtype), spec)
    pm = apply_parallelism(model, plan, mesh, device, lambda m: spec.init_weights(m, 0))
    opt = build_optimizer(pm.module, TrainConfig())
    job = Job.for_model(pm, opt, _Rt(rank, world, device), grad_clip=1.0)
    gen = torch.Generator().manual_seed(rank)
    times = []
    task = CausalLM() if lean else _UnchunkedLM()
    for i in range(steps + 1):
        if i == 1:
            _reset_peak(device)
        batches = []
        for _ in range(args.accumulation):
            tokens = torch.randint(0, shape.vocab_size, (1, args.seq_len + 1), generator=gen)
            batches.append(Batch(tokens[:, :-1], tokens[:, 1:]))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        train_step.forward_backward(job, task, batches, 1.0 / (args.accumulation * args.seq_len * world))
        job.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - t0)
    return times


def _run_variant(variant: str, args, rank: int, world: int, device: torch.device) -> dict:
    # a miniature run first, so that every first-use buffer (gloo, autograd threads, kernels) is in the baseline
    _train(_shape(args, 64, 1, 256), variant, args, rank, world, device, 0)
    base = _rss_bytes()
    _reset_peak(device)
    shape = _shape(args, args.dim, args.layers, args.vocab)
    times = _train(shape, variant, args, rank, world, device, args.steps)
    peak = _peak(device, base)
    return {"variant": variant, "rank": rank, "peak": peak, "step_s": statistics.median(times), "shape": shape}


@dataclasses.dataclass
class _Rt:
    rank: int
    world_size: int
    device: torch.device


def _worker(rank: int, world: int, port: int, args, variants: list[str], out) -> None:
    import torch.distributed as dist

    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group(
        "nccl" if use_cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        out.put([_run_variant(v, args, rank, world, device) for v in variants])
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _predicted(shape, variant: str, args, world: int, on_gpu: bool) -> float:
    from scaletrain.hardware.cluster import make_cluster
    from scaletrain.plan import Layout, Workload
    from scaletrain.plan.memory import MemoryOptions, host_bytes_per_node, memory_breakdown, total_bytes
    from scaletrain.plan.layout import LayoutGrid

    work = Workload("bench", shape, args.seq_len, args.accumulation * world)
    cluster = make_cluster("h100-sxm" if on_gpu else "cpu", world, gpus_per_node=world)
    options = MemoryOptions(
        fsdp_accumulate="unsharded" if variant == "unsharded" else "sharded",
        cpu_offload=variant == "offload",
        lean_activations=variant != "plain-act",
    )
    grid = LayoutGrid.of([Layout(1, world, 1, 1, 1, 1, args.accumulation, "none", args.dtype, "none")])
    device = float(total_bytes(memory_breakdown(work, grid, cluster, None, options))[0])
    host = 0.0 if on_gpu else float(host_bytes_per_node(work, grid, cluster, None, options)[0]) / world
    return device + host


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--accumulation", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--markdown", type=Path, help="replace this file's 'Memory options' section with the table")
    args = ap.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        ap.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")

    import torch.multiprocessing as mp

    rows = []
    for variant in args.variants:
        q = mp.get_context("spawn").SimpleQueue()
        mp.start_processes(
            _worker,
            args=(args.nproc, _free_port(), args, [variant], q),
            nprocs=args.nproc,
            join=True,
            start_method="spawn",
        )
        rows += [r for _ in range(args.nproc) for r in q.get()]
    on_gpu = torch.cuda.is_available()
    base_time = (
        statistics.mean(r["step_s"] for r in rows if r["variant"] == "baseline")
        if "baseline" in args.variants
        else None
    )
    lines = [
        f"FSDP2 on {args.nproc} {'GPU' if on_gpu else 'CPU'} rank(s), {args.dtype}, Llama dim {args.dim} x "
        f"{args.layers} layers, vocabulary {args.vocab}, {args.accumulation} micro-batches of 1 x {args.seq_len} "
        f"tokens, median of {args.steps} steps after one warm-up; peak per rank = "
        f"{'max_memory_allocated' if on_gpu else 'peak RSS over the RSS before the model was built'}.",
        "",
        "| variant | measured peak / rank MB | planner MB | step s | step time vs baseline |",
        "|---|---:|---:|---:|---:|",
    ]
    for v in args.variants:
        mine = [r for r in rows if r["variant"] == v]
        peak = max(r["peak"] for r in mine)
        step = statistics.mean(r["step_s"] for r in mine)
        pred = _predicted(mine[0]["shape"], v, args, args.nproc, on_gpu)
        ratio = f"{step / base_time:.2f}x" if base_time else "-"
        lines.append(f"| {v} | {peak / 2**20:.1f} | {pred / 2**20:.1f} | {step:.3f} | {ratio} |")
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ helpers import each other by name
        import sections  # the shared BENCHMARKS.md section writer
        from peers import machine  # the machine line every benchmark report carries

        sections.write_section(
            args.markdown,
            "## Memory options: accumulation, offload, activations",
            "benchmarks/memory.py",
            argv,
            lines + [""],
            machine(),
            footer=FOOTER,
        )
    return table


if __name__ == "__main__":
    main()
