"""The data path, measured: RSS per rank while training from a small vs a large token dataset, and the data wait as a
share of step time on a slow disk with prefetch on and off.

    python benchmarks/data.py                            # 100 MB vs 4 GB, 2 CPU ranks, 20 steps; slow-disk part
    python benchmarks/data.py --markdown BENCHMARKS.md
    python benchmarks/data.py --small-mb 10 --large-mb 200 --steps 2   # a quick check

RSS: the benchmark writes two flat uint8 token files (byte tokens, vocabulary 256; no id scan is needed) as sparse
files with a 1 MiB block of ids every 64 MiB, written through np.memmap, so 4 GB costs seconds and little disk; it
builds the epoch-0 sample order once (as the first rank of a job would), then trains the tiny model with the real
Trainer on 2 gloo ranks (one torchrun launch per file) and reports each rank's resident memory (VmRSS) after the
last step and its peak (VmHWM). Both files are deleted afterwards. Flat means the large/small ratio stays ~1.0.

Data wait: one process trains the tiny model on the small file through a loader whose every window read sleeps
--read-ms (a slow disk or network file system), once with data.prefetch=0 and once with 2, side by side (batch 4 x 256); the wait
is the time next_step() blocks, as a share of the whole step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ helpers import each other by name

SECTION = "## Data: memory per rank vs dataset size, data wait with prefetch"
SEQ = 256


def write_sparse_tokens(path: Path, size: int) -> None:
    """A `size`-byte uint8 token file: zeros (holes) with a 1 MiB block of ids 0..255 every 64 MiB."""
    with open(path, "wb") as f:
        f.truncate(size)
    mm = np.memmap(path, mode="r+", dtype=np.uint8, shape=(size,))
    block = (np.arange(1 << 20) % 256).astype(np.uint8)
    for start in range(0, size, 64 << 20):
        n = min(len(block), size - start)
        mm[start : start + n] = block[:n]
    mm.flush()
    del mm


def overrides(path: Path, steps: int) -> list[str]:
    return [
        f"data.path={path}",
        "data.token_dtype=uint8",
        f"data.seq_len={SEQ}",
        f"train.steps={steps}",
        "train.global_batch_size=16",
        "monitor.progress=false",
    ]


def worker(path: Path, steps: int, out: Path) -> None:
    """One rank of the RSS run: the real Trainer, `steps` steps, then this rank's VmRSS/VmHWM in MiB."""
    from scaletrain.config import load_config
    from scaletrain.parallel import init_distributed, shutdown_distributed
    from scaletrain.train import Trainer

    rt = init_distributed("cpu")
    trainer = Trainer.build(load_config(None, overrides(path, steps)), rt)
    for step in range(1, steps + 1):
        trainer.train_step(step)
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    mib = {k: int(status[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}
    (out / f"rss_rank{rt.rank}.json").write_text(json.dumps(mib))
    trainer.loader.close()
    shutdown_distributed()


def rss_run(path: Path, steps: int, out: Path) -> list[dict]:
    from scaletrain.config import load_config
    from scaletrain.data.order import cached_permutation
    from scaletrain.data.sources import open_datasets

    cfg = load_config(None, overrides(path, steps))
    (ds,) = open_datasets(cfg.data, 256, 0)
    cached_permutation(ds.cache_dir, (ds.train.num_tokens - 1) // SEQ, cfg.run.seed, 0)  # built once, before ranks
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d"]
    cmd += ["--rdzv-endpoint", "127.0.0.1:0", __file__, "--worker", str(path), str(steps), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return [json.loads((out / f"rss_rank{r}.json").read_text()) for r in range(2)]


def per_rank(rss: list[dict], key: str) -> str:
    return " / ".join(f"{x[key]:.0f}" for x in rss)


class SlowTokens:
    """A token array whose every read sleeps `delay` seconds first, like a slow disk or network file system."""

    def __init__(self, tokens: np.ndarray, delay: float):
        self.tokens, self.delay = tokens, delay

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, key):
        time.sleep(self.delay)
        return self.tokens[key]


def wait_run(path: Path, steps: int, read_ms: float, prefetch: int) -> dict:
    """Single-process training of the tiny model on a slow source; data wait and step time in seconds."""
    import torch

    from scaletrain.config import load_config
    from scaletrain.data import DistributedLoader, TokenWindows, open_datasets
    from scaletrain.data.stream import Segment, TokenStream
    from scaletrain.models.loss import token_loss_sum
    from scaletrain.models.registry import model_spec

    cfg = load_config(None, overrides(path, steps))
    (ds,) = open_datasets(cfg.data, 256, 0)
    slow = TokenStream([Segment(SlowTokens(s.tokens, read_ms / 1e3)) for s in ds.train.segments])  # type: ignore[arg-type]
    windows = TokenWindows(slow.view(0, ds.train.num_tokens), SEQ, cache_dir=ds.cache_dir)
    loader = DistributedLoader(windows, 4, 4, 0, 1, seed=0, prefetch=prefetch)  # 4 windows: 4 slow reads a step
    spec = model_spec(cfg.model)
    torch.manual_seed(0)
    model = spec.build("cpu")
    spec.init_weights(model, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wait = total = 0.0
    for step in range(steps + 1):
        t0 = time.perf_counter()
        (batch,) = loader.next_step()
        t1 = time.perf_counter()
        token_loss_sum(model(batch.inputs), batch.targets).backward()
        opt.step()
        opt.zero_grad()
        if step:  # step 0 warms up (and fills the prefetch queue)
            wait, total = wait + t1 - t0, total + time.perf_counter() - t0
    loader.close()
    return {"wait_s": wait / steps, "step_s": total / steps}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small-mb", type=int, default=100)
    p.add_argument("--large-mb", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--read-ms", type=float, default=5.0, help="sleep per window read in the slow-disk part")
    p.add_argument("--wait-steps", type=int, default=20)
    p.add_argument("--dir", default=None, help="where the token files go (default: a temporary folder)")
    p.add_argument("--markdown", default=None, help="write the results into this file's section")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="scaletrain-data-bench-") as tmp:
        root = Path(tmp)
        rows = []
        for label, mb in (("small", a.small_mb), ("large", a.large_mb)):
            path = root / f"{label}.tokens"
            t0 = time.perf_counter()
            write_sparse_tokens(path, mb * 10**6)
            made = time.perf_counter() - t0
            rss = rss_run(path, a.steps, root / f"out_{label}")
            rows.append((label, mb, made, rss))
            print(
                f"{label}: {mb} MB written in {made:.1f} s; RSS per rank (MiB) {per_rank(rss, 'VmRSS')}, "
                f"peak {per_rank(rss, 'VmHWM')}",
                flush=True,
            )
            if label == "large":
                path.unlink()
        small_rss = max(x["VmRSS"] for x in rows[0][3])
        large_rss = max(x["VmRSS"] for x in rows[1][3])
        ratio = large_rss / small_rss
        print(f"RSS large/small (max over ranks): {ratio:.3f}")
        waits = {n: wait_run(root / "small.tokens", a.wait_steps, a.read_ms, n) for n in (0, 2)}
        for n, w in waits.items():
            print(
                f"prefetch={n}: data wait {w['wait_s'] * 1e3:.1f} ms of a {w['step_s'] * 1e3:.1f} ms step "
                f"({100 * w['wait_s'] / w['step_s']:.1f} %)"
            )
    if a.markdown:
        import sections
        from peers import machine

        report = [
            "| dataset | size | RSS per rank after the last step (MiB) | peak RSS per rank (MiB) |",
            "|---|---|---|---|",
            *(
                f"| {label} | {mb} MB | {per_rank(rss, 'VmRSS')} | {per_rank(rss, 'VmHWM')} |"
                for label, mb, _, rss in rows
            ),
            "",
            f"RSS large/small (max over ranks): **{ratio:.3f}** (target: within 10 %).",
            "",
            f"| slow disk ({a.read_ms:g} ms per window read) | data wait per step | step | wait share |",
            "|---|---|---|---|",
            *(
                f"| data.prefetch={n} | {w['wait_s'] * 1e3:.1f} ms | {w['step_s'] * 1e3:.1f} ms | "
                f"{100 * w['wait_s'] / w['step_s']:.1f} % |"
                for n, w in waits.items()
            ),
            "",
        ]
        sections.write_section(Path(a.markdown), SECTION, "benchmarks/data.py", None, report, machine())


if __name__ == "__main__":
    main()
