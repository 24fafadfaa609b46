"""scaletrain against what a user would pick instead: a hand-written torch loop (DDP and FSDP2), Hugging Face
Accelerate and Lightning Fabric. Same built-in model, init, data windows, global batch, precision and steps; each
runner started by its own launcher, as its documentation shows; runs alternate (every runner once per rep, the
order rotated each rep) so drift on a shared machine hits all of them.

    python benchmarks/peers.py                        # 2 CPU ranks over gloo, tiny model, fp32
    python benchmarks/peers.py --markdown BENCHMARKS.md
    python benchmarks/peers.py --device cuda          # all local GPUs: llama-1b, bf16, torch.compile, FSDP2

Every figure comes from benchmarks/probe/sitecustomize.py, loaded into every process of every runner, so no
runner's own timing code is trusted: step time is the mean of each `--log-every`-step window between ends of
optimizer steps on rank 0 (first window dropped as warm-up, median over all windows of all reps); start-up is the
launch of the command to the end of step 1 on the last rank; peak RSS is ru_maxrss of each rank process; rank 0's
CPU time per step (process_time over the same windows) is given beside the step time, as it is far less sensitive to
other load on the machine. --cprofile A:B and --ops A:B (torch.profiler op counts and self times) show where the
time goes.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
PROBE = HERE / "probe"
ROOT = HERE.parent

# runner -> (strategy, what it is); scaletrain rows are the reference of their strategy
RUNNERS = {
    "scaletrain-ddp": ("ddp", "`scaletrain train` parallel.dp_replicate=N"),
    "torch-ddp": ("ddp", "benchmarks/plain_ddp.py under torchrun"),
    "accelerate-ddp": ("ddp", "benchmarks/peer_accelerate.py under `accelerate launch`"),
    "fabric-ddp": ("ddp", "benchmarks/peer_fabric.py under `fabric run`"),
    "scaletrain-fsdp": ("fsdp", "`scaletrain train` parallel.dp_shard=N"),
    "torch-fsdp2": ("fsdp", "benchmarks/plain_fsdp.py under torchrun"),
    # the same job on a transformers LlamaForCausalLM of the preset's shape (same_job.py --hf); on CPU ranks
    # Accelerate's FSDP falls back to no distribution at all and Fabric's FSDP refuses anything but GPUs: both DDP
    "scaletrain-hf-fsdp": ("hf-fsdp", "benchmarks/setup_hf.py (scaletrain.setup, FSDP2) under torchrun"),
    "scaletrain-hf-ddp": ("hf-ddp", "benchmarks/setup_hf.py --ddp (scaletrain.setup, DDP) under torchrun"),
    "accelerate-hf-ddp": ("hf-ddp", "benchmarks/peer_accelerate.py --hf under `accelerate launch`"),
    "fabric-hf-ddp": ("hf-ddp", "benchmarks/peer_fabric.py --hf under `fabric run`"),
}
GPU_RUNNERS = ["scaletrain-fsdp", "torch-fsdp2"]
TEARDOWN_GRACE_S = 20.0
NOTES = "## Notes"
TARGET = {"torch-ddp": 1.03, "torch-fsdp2": 1.00, "accelerate-ddp": 1.00, "fabric-ddp": 1.00}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tool(name: str) -> str:
    """A console script of this environment (next to the interpreter), else from PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def job_flags(a, hf: bool = False) -> list[str]:
    flags = [
        "--model",
        a.model,
        "--steps",
        str(a.steps),
        "--log-every",
        str(a.log_every),
        "--seq-len",
        str(a.seq_len),
        "--global-batch",
        str(a.global_batch),
        "--max-bytes",
        str(a.max_bytes),
        "--device",
        a.device,
        "--dtype",
        a.dtype,
    ]
    return flags + (["--compile"] if a.compile else []) + (["--hf"] if hf else [])


def command(name: str, a) -> list[str]:
    n = str(a.nproc)
    hf = "-hf-" in name
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        n,
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:0",
    ]
    if name in ("scaletrain-ddp", "scaletrain-fsdp"):
        layout = (
            [f"parallel.dp_replicate={n}", "parallel.dp_shard=1"]
            if name.endswith("ddp")
            else ["parallel.dp_replicate=1", f"parallel.dp_shard={n}"]
        )
        return [
            sys.executable,
            "-m",
            "scaletrain.cli.main",
            "train",
            f"model.name={a.model}",
            f"train.steps={a.steps}",
            f"monitor.log_interval={a.log_every}",
            f"data.seq_len={a.seq_len}",
            f"train.global_batch_size={a.global_batch}",
            f"data.max_bytes={a.max_bytes}",
            f"launch.nproc_per_node={n}",
            f"run.device={a.device}",
            f"precision.dtype={a.dtype}",
            f"parallel.compile={str(a.compile).lower()}",
            "train.eval_interval=0",
            "train.eval_batches=1",
            "monitor.progress=false",
            "run.name=bench",
            *layout,
        ]
    if name == "torch-ddp":
        return [*torchrun, str(HERE / "plain_ddp.py"), *job_flags(a)]
    if name == "torch-fsdp2":
        return [*torchrun, str(HERE / "plain_fsdp.py"), *job_flags(a)]
    if name.startswith("scaletrain-hf"):
        return [*torchrun, str(HERE / "setup_hf.py"), *job_flags(a, hf), *(["--ddp"] if name.endswith("ddp") else [])]
    if name in ("accelerate-ddp", "accelerate-hf-ddp"):
        # --multi_gpu is Accelerate's torchrun path; the script passes cpu=True, so the ranks use gloo on CPU
        # (`--cpu --num_processes 2` starts a single process: Accelerate's multi-CPU launch needs mpirun)
        return [
            tool("accelerate"),
            "launch",
            "--multi_gpu",
            "--num_processes",
            n,
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(free_port()),
            str(HERE / "peer_accelerate.py"),
            *job_flags(a, hf),
        ]
    if name in ("fabric-ddp", "fabric-hf-ddp"):
        return [
            tool("fabric"),
            "run",
            "--accelerator",
            a.device,
            "--devices",
            n,
            "--strategy",
            "ddp",
            "--main-port",
            str(free_port()),
            str(HERE / "peer_fabric.py"),
            *job_flags(a, hf),
        ]
    raise ValueError(f"--runners: unknown runner {name!r}; choose from {', '.join(RUNNERS)}")


@dataclass
class Run:
    windows: list[float]  # mean step time of each window after the first, s
    cpu_windows: list[float]  # rank 0's CPU time (all its threads) per step in the same windows, s
    startup_s: float  # launch -> end of step 1 on the last rank
    rss_mib: list[float]  # peak RSS of each rank, by rank
    threads: set[int]
    stopped_in_teardown: bool = False
    profiles: list[Path] = field(default_factory=list)  # rank 0's cProfile (--cprofile)
    ops: list[Path] = field(default_factory=list)  # rank 0's torch.profiler op table (--ops)


def read_probe(folder: Path, launched_unix: float, log_every: int, nproc: int) -> Run:
    ranks = []
    for path in folder.glob("rank*.jsonl"):
        lines = path.read_text().splitlines()
        head, steps = json.loads(lines[0]), [json.loads(x) for x in lines[1:]]
        ranks.append((head["rank"], head, steps))
    ranks.sort(key=lambda r: r[0])
    if len(ranks) != nproc:
        raise RuntimeError(f"probe: {len(ranks)} rank record(s) in {folder}, expected {nproc}")
    t = [s[0] for s in ranks[0][2]]
    cpu = [s[2] for s in ranks[0][2]]

    def per_step(x: list[float]) -> list[float]:
        return [(x[(j + 1) * log_every - 1] - x[j * log_every - 1]) / log_every for j in range(1, len(x) // log_every)]

    return Run(
        per_step(t),
        per_step(cpu),
        max(h["first_step_unix"] for _, h, _ in ranks) - launched_unix,
        [s[-1][1] / 1024 for _, _, s in ranks],
        {h["threads"] for _, h, _ in ranks},
    )


def _steps_done(probe: Path, steps: int, nproc: int) -> bool:
    files = list(probe.glob("rank*.jsonl"))
    return len(files) == nproc and all(len(f.read_text().splitlines()) > steps for f in files)


def run_once(name: str, a, workdir: Path, env: dict) -> Run:
    """One run of one runner. Ranks of every runner here (with or without the probe) sometimes hang in gloo
    teardown after their last step; once every rank has logged its last step the command gets TEARDOWN_GRACE_S
    to exit and is then stopped. Nothing measured happens after the last step, so such a run still counts."""
    probe = Path(tempfile.mkdtemp(dir=workdir, prefix=f"probe-{name}-"))
    env = {**env, "SCALETRAIN_BENCH_PROBE": str(probe)}
    if a.cprofile:
        env["SCALETRAIN_BENCH_CPROFILE"] = a.cprofile
    if a.ops:
        env["SCALETRAIN_BENCH_OPS"] = a.ops
    log = workdir / f"{name}.log"
    with open(log, "w") as out:
        launched = time.time()
        proc = subprocess.Popen(
            command(name, a), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=workdir, start_new_session=True
        )
        done_at = None
        ranks: dict[int, psutil.Process] = {}  # every process the run started, whatever session it moved to
        while proc.poll() is None:
            time.sleep(0.2)
            try:
                ranks.update((c.pid, c) for c in psutil.Process(proc.pid).children(recursive=True))
            except psutil.Error:
                pass
            now = time.time()
            if done_at is None and _steps_done(probe, a.steps, a.nproc):
                done_at = now
            if now - launched > a.timeout or (done_at is not None and now - done_at > TEARDOWN_GRACE_S):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
        try:  # a launcher that exited can leave ranks of its session behind (hung in teardown): stop them too
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        # Fabric's launcher starts its other ranks as children that can outlive it in a session of their own
        for rank in ranks.values():
            try:
                rank.kill()
            except psutil.Error:
                pass
    if not _steps_done(probe, a.steps, a.nproc) or (done_at is None and proc.returncode != 0):
        raise RuntimeError(
            f"{name} exited {proc.returncode} before its last step; last output:\n{log.read_text()[-3000:]}"
        )
    run = read_probe(probe, launched, a.log_every, a.nproc)
    run.stopped_in_teardown = proc.returncode != 0
    if a.cprofile:  # the probe folder goes with the work folder: keep rank 0's profile
        a.profile_dir.mkdir(parents=True, exist_ok=True)
        for f in probe.glob("rank0-*.pstats"):
            run.profiles.append(Path(shutil.copy(f, a.profile_dir / f"{name}-{probe.name}.pstats")))
    if a.ops:
        a.profile_dir.mkdir(parents=True, exist_ok=True)
        for f in probe.glob("rank0-*.ops.json"):
            run.ops.append(Path(shutil.copy(f, a.profile_dir / f"{name}-{probe.name}.ops.json")))
    return run


@dataclass
class Row:
    name: str
    runs: list[Run] = field(default_factory=list)

    @property
    def step_s(self) -> float:
        return statistics.median(w for r in self.runs for w in r.windows)

    @property
    def cpu_s(self) -> float:
        return statistics.median(w for r in self.runs for w in r.cpu_windows)

    @property
    def startup_s(self) -> float:
        return statistics.median(r.startup_s for r in self.runs)

    @property
    def rss_mib(self) -> float:
        return statistics.median(max(r.rss_mib) for r in self.runs)


def mfu(a, step_s: float) -> float | None:
    """Model FLOPs utilisation on GPUs: 6N + attention FLOPs per token x tokens/s over the GPUs' dense bf16 peak
    (the scaletrain hardware catalog's figure for this GPU); None when the GPU is not in the catalog."""
    import torch

    from scaletrain.config import ModelConfig
    from scaletrain.hardware.catalog import get_gpu
    from scaletrain.hardware.detect import catalog_name_for
    from scaletrain.models import model_spec

    name = catalog_name_for(torch.cuda.get_device_name())
    if name is None:
        return None
    flops = model_spec(ModelConfig(name=a.model)).flops_per_token(a.seq_len) * a.global_batch * a.seq_len / step_s
    return flops / (a.nproc * get_gpu(name).bf16_flops)


def table(rows: list[Row], a) -> list[str]:
    ref = {RUNNERS[r.name][0]: r for r in rows if r.name.startswith("scaletrain")}
    tokens = a.global_batch * a.seq_len
    head = (
        "| runner | median step (ms) | rank 0 CPU / step (ms) | tokens/s | start-up to step 1 (s) | "
        "peak RSS / rank (MiB) | scaletrain ÷ runner (step time) | each rep | target | scaletrain ÷ runner (CPU) |"
    )
    if a.device == "cuda":
        head = head.replace(" | scaletrain ÷ runner (step", " | MFU | scaletrain ÷ runner (step")
    out = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        s = ref.get(RUNNERS[r.name][0])
        ratio = "—" if r.name.startswith("scaletrain") or s is None else f"{s.step_s / r.step_s:.3f}"
        # the runs of one rep are back to back: their ratio is free of the drift between reps
        paired = (
            ""
            if ratio == "—"
            else " ".join(
                f"{statistics.median(x.windows) / statistics.median(y.windows):.2f}" for x, y in zip(s.runs, r.runs)
            )
        )
        target = f"≤ {TARGET[r.name]:.2f}" if r.name in TARGET and s is not None else ""
        cpu_ratio = "" if ratio == "—" else f"{s.cpu_s / r.cpu_s:.3f}"
        cells = [
            r.name,
            f"{r.step_s * 1e3:.1f}",
            f"{r.cpu_s * 1e3:.1f}",
            f"{tokens / r.step_s:,.0f}",
            f"{r.startup_s:.1f}",
            f"{r.rss_mib:,.0f}",
        ]
        if a.device == "cuda":
            m = mfu(a, r.step_s)
            cells.append("n/a" if m is None else f"{m:.1%}")
        out.append("| " + " | ".join(cells + [ratio, paired, target, cpu_ratio]) + " |")
    return out


def machine() -> str:
    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else ""
    )
    versions = []
    for pkg in ("torch", "accelerate", "lightning-fabric"):
        try:
            versions.append(f"{pkg} {importlib.metadata.version(pkg)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{pkg} not installed")
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores ({cpu}), Python "
        f"{platform.python_version()}, {', '.join(versions)}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--runners", help=f"comma-separated subset of: {', '.join(RUNNERS)}")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--log-every", type=int, default=10, help="window length; the first window is warm-up")
    ap.add_argument("--model", help="preset; default tiny on cpu, llama-1b on cuda")
    ap.add_argument("--seq-len", type=int, help="default 256 on cpu, 2048 on cuda")
    ap.add_argument("--global-batch", type=int, help="sequences per step; default 16 on cpu, 4 per GPU on cuda")
    ap.add_argument("--max-bytes", type=int, default=1_000_000, help="stdlib text read as the token stream")
    ap.add_argument("--nproc", type=int, help="ranks; default 2 on cpu, every visible GPU on cuda")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every rank (cpu)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    ap.add_argument("--markdown", type=Path, help="also write the report (table, date, machine, command) here")
    ap.add_argument("--note", default="", help="a line for the report, e.g. what else ran on the machine")
    ap.add_argument(
        "--cprofile",
        metavar="A:B",
        help="cProfile every rank's main thread from the end of step A "
        "to the end of step B; rank 0's .pstats go to --profile-dir and the top functions per step are "
        "printed per runner (profiled steps are slower: read the profile, not the table)",
    )
    ap.add_argument(
        "--ops",
        metavar="A:B",
        help="torch.profiler (CPU) on every rank from the end of step A to the end of step B; rank 0's op tables "
        "go to --profile-dir and each scaletrain row's ops are compared with its strategy's other runners "
        "(calls and self CPU time per step)",
    )
    ap.add_argument("--profile-dir", type=Path, default=Path("peers-profile"), help="where --cprofile/--ops write")
    a = ap.parse_args(argv)
    gpu = a.device == "cuda"
    if gpu:
        import torch

        if not torch.cuda.is_available():
            ap.error("--device cuda: no CUDA GPU is visible here; run it on a GPU host")
        a.nproc = a.nproc or torch.cuda.device_count()
        if a.nproc < 2:
            ap.error(f"--device cuda: needs 2+ GPUs for FSDP (found {a.nproc}); set --nproc")
    a.nproc = a.nproc or 2
    a.model = a.model or ("llama-1b" if gpu else "tiny")
    a.seq_len = a.seq_len or (2048 if gpu else 256)
    a.global_batch = a.global_batch or (4 * a.nproc if gpu else 16)
    a.dtype, a.compile = ("bf16", True) if gpu else ("fp32", False)
    a.runners = a.runners.split(",") if a.runners else (GPU_RUNNERS if gpu else list(RUNNERS))
    for name in a.runners:
        if name not in RUNNERS:
            ap.error(f"--runners: unknown runner {name!r}; choose from {', '.join(RUNNERS)}")
    if a.steps < 2 * a.log_every:
        a.log_every = max(1, a.steps // 2)
    if a.global_batch % a.nproc:
        ap.error(f"--global-batch {a.global_batch} must be a multiple of --nproc {a.nproc}")
    for flag, window in (("--cprofile", a.cprofile), ("--ops", a.ops)):
        if not window:
            continue
        try:
            start, stop = (int(x) for x in window.split(":"))
        except ValueError:
            ap.error(f"{flag}: expected A:B, two step numbers (got {window!r})")
        if not 1 <= start < stop <= a.steps:
            ap.error(f"{flag} {window}: need 1 <= A < B <= --steps {a.steps}")
    return a


def print_profiles(rows: dict, a, top: int = 15) -> None:
    """Rank 0's cProfile of every rep merged per runner: the functions with the most own time per step."""
    import pstats

    start, stop = (int(x) for x in a.cprofile.split(":"))
    for name, row in rows.items():
        files = [f for run in row.runs for f in run.profiles]
        if not files:
            print(f"\n{name}: no profile written (did rank 0 run steps {a.cprofile}?)")
            continue
        merged = a.profile_dir / f"{name}.pstats"
        stats = pstats.Stats(*map(str, files))
        stats.dump_stats(merged)
        per_step = 1e3 / ((stop - start) * len(files))
        entries = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
        print(
            f"\n{name}: rank 0, steps {start + 1}-{stop}, {len(files)} rep(s), own time ms/step "
            f"(full profile: python -m pstats {merged})"
        )
        for (path, line, func), (_, calls, tottime, cumtime, _) in entries:
            where = f"{Path(path).name}:{line}" if line else path
            calls_per_step = calls / (len(files) * (stop - start))
            print(
                f"  {tottime * per_step:8.2f}  {cumtime * per_step:8.2f} cum  {calls_per_step:7.1f}/step  {func}  "
                f"{where}"
            )


def _ops_per_step(files: list[Path], steps: int) -> dict[str, tuple[float, float]]:
    """{op: (calls per step, self CPU ms per step)} over the reps' op tables."""
    total: dict[str, list[float]] = {}
    for f in files:
        for op, (calls, self_us) in json.loads(f.read_text()).items():
            t = total.setdefault(op, [0.0, 0.0])
            t[0] += calls
            t[1] += self_us
    n = steps * len(files)
    return {op: (calls / n, self_us / 1e3 / n) for op, (calls, self_us) in total.items()}


def print_ops(rows: dict, a, top: int = 25) -> None:
    """Rank 0's torch.profiler ops per step: each scaletrain row against every other runner of its strategy, the ops
    whose calls per step differ and those whose self CPU time differs most."""
    start, stop = (int(x) for x in a.ops.split(":"))
    tables = {name: _ops_per_step([f for run in row.runs for f in run.ops], stop - start) for name, row in rows.items()}
    for name, ours in tables.items():
        if not name.startswith("scaletrain") or not ours:
            continue
        for peer, theirs in tables.items():
            if peer == name or RUNNERS[peer][0] != RUNNERS[name][0] or not theirs:
                continue
            total = (sum(v[1] for v in ours.values()), sum(v[1] for v in theirs.values()))
            print(
                f"\n{name} vs {peer}: rank 0, steps {start + 1}-{stop}, self CPU ms/step {total[0]:.1f} vs "
                f"{total[1]:.1f}; ops by difference in self CPU time (calls/step in brackets)"
            )
            diffs = []
            for op in set(ours) | set(theirs):
                (c0, t0), (c1, t1) = ours.get(op, (0.0, 0.0)), theirs.get(op, (0.0, 0.0))
                diffs.append((t0 - t1, op, c0, c1, t0, t1))
            diffs.sort(key=lambda d: -abs(d[0]))
            for d, op, c0, c1, t0, t1 in diffs[:top]:
                mark = "  calls differ" if abs(c0 - c1) > 1e-9 else ""
                print(f"  {d:+8.2f}  {t0:8.2f} ({c0:6.1f})  {t1:8.2f} ({c1:6.1f})  {op}{mark}")
            extra = sorted((op for op in ours if abs(ours[op][0] - theirs.get(op, (0.0, 0.0))[0]) > 1e-9))
            print(
                "  ops called a different number of times per step: "
                + ", ".join(f"{op} {ours[op][0]:.1f} vs {theirs.get(op, (0.0, 0.0))[0]:.1f}" for op in extra)
            )


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(PROBE), os.environ.get("PYTHONPATH")) if p)}
    if a.device == "cpu":
        env["OMP_NUM_THREADS"] = str(a.threads)
    rows = {name: Row(name) for name in a.runners}
    with tempfile.TemporaryDirectory(prefix="scaletrain-peers-") as tmp:
        for rep in range(a.reps):
            k = rep % len(a.runners)  # rotate the order so that no runner always goes first
            for name in a.runners[k:] + a.runners[:k]:
                print(f"rep {rep + 1}/{a.reps}: {name}", file=sys.stderr, flush=True)
                rows[name].runs.append(run_once(name, a, Path(tmp), env))
    threads = sorted({t for r in rows.values() for run in r.runs for t in run.threads})
    title = (
        f"model {a.model}, {a.nproc} {a.device.upper()} ranks ({'nccl' if a.device == 'cuda' else 'gloo'}), "
        f"{a.dtype}{', torch.compile' if a.compile else ''}, {a.steps} steps x {a.global_batch} x "
        f"{a.seq_len} tokens, {a.reps} alternating reps, intra-op threads per rank {threads}"
    )
    stopped = sum(run.stopped_in_teardown for r in rows.values() for run in r.runs)
    if stopped:
        title += f"; {stopped} run(s) stopped after their last step, hung in process-group teardown"
    lines = table(list(rows.values()), a)
    print(title)
    print("\n".join(lines))
    if a.cprofile:
        print_profiles(rows, a)
    if a.ops:
        print_ops(rows, a)
    if a.markdown:
        write_report(a.markdown, title, lines, a, argv)


def write_report(path: Path, title: str, lines: list[str], a, argv: list[str] | None) -> None:
    args = sys.argv[1:] if argv is None else argv
    cmd = shlex.join(["python", "benchmarks/peers.py", *args])
    text = [
        "# Benchmarks: scaletrain against the peers a user would pick instead",
        "",
        f"Latest run: {datetime.date.today().isoformat()}, produced by `{cmd}`.",
        "",
        f"Machine: {machine()}.",
        "",
        *([a.note, ""] if a.note else []),
        f"{title}.",
        "",
        *lines,
        "",
        "How each figure is measured (benchmarks/README.md has the details): one probe, loaded into every process "
        "of every runner (benchmarks/probe/sitecustomize.py), times the end of each optimizer step; **step time** "
        f"is the mean of each {a.log_every}-step window on rank 0, the first window dropped as warm-up, median "
        "over all windows of all reps; **tokens/s** is global batch x sequence length / step time; "
        "**rank 0 CPU / step** is the CPU time of rank 0's process (all its threads, time.process_time) per step in "
        "the same windows, which load from other processes on the machine inflates far less than wall time; "
        "**start-up** is from launching the runner's command to the end of step 1 on the last rank (median of "
        "reps); **peak RSS / rank** is the largest ru_maxrss of the rank processes (median of reps). "
        "**scaletrain ÷ runner** divides scaletrain's step time (same strategy) by the runner's: below 1 means "
        "scaletrain is faster; **each rep** gives the same ratio for every rep alone (its two runs were back to "
        "back), which shows how far the machine drifts between reps.",
        "",
    ]
    # hand-written notes (evidence for a ratio, a peer that could not run) survive a rerun
    old = path.read_text() if path.exists() else ""
    notes = old[old.index(NOTES) :] if NOTES in old else ""
    path.write_text("\n".join(text) + ("\n" + notes if notes else ""))


if __name__ == "__main__":
    main()
