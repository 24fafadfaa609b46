"""FP8 (torchao float8) against bf16 on the same job: loss curves side by side and the step-time ratio.

    python benchmarks/fp8.py [--steps 50] [--recipe tensorwise] [--layout fsdp]     # 2 CPU ranks, emulated fp8
    python benchmarks/fp8.py --device cuda --gpu h200 [--model llama-1b]           # one GPU, compile on

CPU: fp8 is emulated (the casts and scales of fp8, the matmul in fp32), so its step-time ratio against bf16 says how
much the emulation costs, nothing about fp8 speed on a GPU; the loss agreement is the real result there.
CUDA: llama-1b on one GPU with parallel.compile=true, bf16 then fp8, median tokens/s of the steps after the first
logging window (compile warm-up), next to the planner's prediction for the same layout on the catalog GPU `--gpu`.
Runs alternate (bf16, fp8, bf16, fp8 ...) so drift on a shared machine hits both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUTS = {
    "fsdp": ["parallel.dp_shard=2"],
    "ddp": ["parallel.dp_replicate=2", "parallel.dp_shard=1"],
    "tp": ["parallel.tp=2", "parallel.dp_shard=1"],
    "pp": ["parallel.pp=2", "parallel.dp_shard=1"],
}


def run(overrides: list[str], workdir: Path, name: str, nproc: int) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "scaletrain.cli.main",
        "train",
        *overrides,
        "monitor.progress=false",
        "train.eval_interval=0",
        "train.eval_batches=1",
        f"run.name={name}",
        "--nproc-per-node",
        str(nproc),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=workdir)
    if proc.returncode != 0:
        sys.exit(f"fp8 benchmark: {name} failed:\n{proc.stderr[-3000:]}")
    lines = (workdir / "runs" / name / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def predicted_tokens_per_s(a, fp8: str) -> float:
    """The planner's tokens/s for this job on one catalog GPU (bf16, the micro-batch the job runs)."""
    from scaletrain.hardware import make_cluster
    from scaletrain.models import preset_spec
    from scaletrain.plan import Layout, Workload, evaluate_layout

    work = Workload(a.model, preset_spec(a.model).shape(), a.seq_len, a.global_batch, fp8)
    layout = Layout(1, 1, 1, 1, 1, a.global_batch, 1, "none", "bf16", "none")
    return work.tokens_per_step / evaluate_layout(work, make_cluster(a.gpu, 1), layout).step_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--recipe", choices=("tensorwise", "rowwise"), default="tensorwise")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="fsdp", help="CPU: the 2-rank layout")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--steps", type=int, default=None, help="default: 50 on CPU, 60 on CUDA")
    ap.add_argument("--model", default=None, help="default: tiny on CPU, llama-1b on CUDA")
    ap.add_argument("--seq-len", type=int, default=None, help="default: 64 on CPU, 2048 on CUDA")
    ap.add_argument("--global-batch", type=int, default=None, help="default: 16 on CPU, 8 on CUDA")
    ap.add_argument("--gpu", default="h200", help="CUDA: the catalog GPU the planner predicts for")
    a = ap.parse_args()
    cuda = a.device == "cuda"
    a.steps = a.steps or (60 if cuda else 50)
    a.model = a.model or ("llama-1b" if cuda else "tiny")
    a.seq_len = a.seq_len or (2048 if cuda else 64)
    a.global_batch = a.global_batch or (8 if cuda else 16)
    log_every = 10 if cuda else 1
    common = [
        f"model.name={a.model}",
        f"train.steps={a.steps}",
        f"monitor.log_interval={log_every}",
        f"data.seq_len={a.seq_len}",
        f"train.global_batch_size={a.global_batch}",
        "precision.dtype=bf16",
        f"run.device={a.device}",
    ]
    if cuda:
        common += ["data.source=synthetic", "parallel.compile=true", "parallel.dp_shard=1"]
        nproc = 1
    else:
        common += ["data.max_bytes=300000", "train.warmup_steps=2", *LAYOUTS[a.layout]]
        nproc = 2
    fp8 = [f"precision.fp8={a.recipe}"]
    records: dict[str, list[list[dict]]] = {"bf16": [], "fp8": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            records["bf16"].append(run(common, Path(tmp), f"bf16_{rep}", nproc))
            records["fp8"].append(run(common + fp8, Path(tmp), f"fp8_{rep}", nproc))

    def median(key: str, name: str) -> float:
        # the first logging window holds start-up (and compile) time: dropped
        return statistics.median(r[key] for rs in records[name] for r in rs[1:])

    where = f"1 GPU ({a.gpu} in the planner)" if cuda else f"2 CPU ranks ({a.layout}, gloo), fp8 EMULATED"
    print(
        f"model {a.model}, {where}, {a.steps} steps x {a.global_batch} x {a.seq_len} tokens, "
        f"fp8 recipe {a.recipe}, {a.reps} alternating rep(s)"
    )
    bf16, f8 = records["bf16"][0], records["fp8"][0]
    print(f"{'step':>6}{'bf16 loss':>12}{'fp8 loss':>12}{'rel diff':>10}")
    for b, f in zip(bf16, f8):
        print(f"{b['step']:>6}{b['loss']:>12.4f}{f['loss']:>12.4f}{abs(f['loss'] - b['loss']) / b['loss']:>10.2%}")
    worst = max(abs(f["loss"] - b["loss"]) / b["loss"] for b, f in zip(bf16, f8))
    print(f"worst step loss difference: {worst:.2%}")
    ratio = median("step_time_s", "fp8") / median("step_time_s", "bf16")
    if not cuda:
        print(
            f"step time fp8 / bf16 (emulated on CPU, not a speed figure): {ratio:.3f} "
            f"({median('step_time_s', 'fp8') * 1e3:.1f} ms vs {median('step_time_s', 'bf16') * 1e3:.1f} ms)"
        )
        return
    print(f"{'precision':<12}{'measured tokens/s':>20}{'predicted tokens/s':>20}")
    for name, recipe in (("bf16", "none"), ("fp8", a.recipe)):
        print(f"{name:<12}{median('tokens_per_s', name):>20,.0f}{predicted_tokens_per_s(a, recipe):>20,.0f}")
    print(
        f"speed-up fp8 / bf16: measured {1 / ratio:.3f}, predicted "
        f"{predicted_tokens_per_s(a, a.recipe) / predicted_tokens_per_s(a, 'none'):.3f}"
    )


if __name__ == "__main__":
    main()
