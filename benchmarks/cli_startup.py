"""How fast the `scaletrain` command answers: wall time of commands that need no training, each a fresh process,
next to a bare interpreter and an interpreter that only imports torch.

    python benchmarks/cli_startup.py [--reps 7]
    python benchmarks/cli_startup.py --markdown BENCHMARKS.md

Each command runs --reps times (rows interleaved, so drift on a shared machine hits every row alike) as
`python -m scaletrain.cli.main ...` with this interpreter and environment; the table shows the median and the
ratio to `python -c pass` and to `python -c "import torch"`. `ckpt ls` lists a tiny fake checkpoint folder the
script writes (a manifest and one 1 KiB file: nothing a real checkpoint adds changes what `ls` imports).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ helpers import each other by name

import sections  # the shared BENCHMARKS.md section writer
from peers import machine  # the machine line every benchmark report carries

SECTION = "## CLI start-up: time to answer"
CLI = [sys.executable, "-m", "scaletrain.cli.main"]


def fake_checkpoint(root: Path) -> Path:
    """A run folder with one committed-looking checkpoint (format of scaletrain.checkpoint.manifest)."""
    step = root / "runs" / "fake" / "checkpoints" / "step_00000010"
    step.mkdir(parents=True)
    data = bytes(range(256)) * 4
    (step / "__0_0.distcp").write_bytes(data)
    manifest = {
        "format": "scaletrain-dcp-1",
        "step": 10,
        "time": time.time(),
        "world_size": 2,
        "layout": "ddp",
        "files": {"__0_0.distcp": {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}},
        "bytes": len(data),
    }
    (step / "manifest.json").write_text(json.dumps(manifest))
    return root / "runs" / "fake"


def commands(run: Path) -> dict[str, list[str]]:
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        'python -c "import torch"': [sys.executable, "-c", "import torch"],
        "scaletrain --help": [*CLI, "--help"],
        "scaletrain models": [*CLI, "models"],
        "scaletrain ckpt ls RUN": [*CLI, "ckpt", "ls", str(run)],
        "scaletrain plan --model llama-8b --gpus 8": [*CLI, "plan", "--model", "llama-8b", "--gpus", "8"],
    }


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return elapsed


def table(times: dict[str, list[float]]) -> list[str]:
    bare = statistics.median(times["python -c pass"])
    torch = statistics.median(times['python -c "import torch"'])
    lines = ["| command | median (s) | ÷ `python -c pass` | ÷ `import torch` |", "|---|---|---|---|"]
    for name, ts in times.items():
        t = statistics.median(ts)
        lines.append(f"| `{name}` | {t:.3f} | {t / bare:.1f} | {t / torch:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7, help="runs of each command (fresh process each)")
    ap.add_argument("--markdown", type=Path, help=f"also write the table into this file's '{SECTION}' section")
    ap.add_argument("--note", default="", help="a line for the report, e.g. what else ran on the machine")
    a = ap.parse_args(argv)
    if a.reps < 1:
        ap.error("--reps: need at least 1")
    with tempfile.TemporaryDirectory(prefix="scaletrain-cli-bench-") as tmp:
        cmds = commands(fake_checkpoint(Path(tmp)))
        times: dict[str, list[float]] = {name: [] for name in cmds}
        for rep in range(a.reps):
            print(f"rep {rep + 1}/{a.reps}", file=sys.stderr, flush=True)
            for name, cmd in cmds.items():
                times[name].append(timed(cmd))
    title = f"Median wall time of {a.reps} fresh processes per command (rows interleaved)."
    lines = table(times)
    print(title)
    print("\n".join(lines))
    if a.markdown:
        sections.write_section(
            a.markdown,
            SECTION,
            "benchmarks/cli_startup.py",
            argv,
            [title, "", *lines, ""],
            machine(),
            a.note,
            "How each figure is measured: benchmarks/cli_startup.py's docstring.",
        )


if __name__ == "__main__":
    main()
