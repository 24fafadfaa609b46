"""The traced planner's step time (plan/traced.py) next to the measured one, for the families the decoder formulas
do not describe: a ViT (image classification), a diffusion UNet, a DLRM recommender with sharded tables, and the
built-in mixture-of-experts decoder (routing traced as uniform). Each family runs the data-parallel layouts a trace
plans on N CPU ranks (gloo, fp32): DDP, FSDP2, each with gradient accumulation, and DDP with full activation
checkpointing. The prediction is `plan/traced.py job_row` for the very config the run used, with the figures of a
`scaletrain bench` file; the data are made here (noise images, a click log).

    scaletrain bench --nproc 4 -o cal.toml
    python benchmarks/planner_families.py --calibration cal.toml [--nproc 4] [--steps 16] [--families vit,unet]
                                          [--json OUT.json] [--from-json OUT.json] [--markdown FILE]

--json keeps the measured rows; --from-json predicts again for rows measured before (no runs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scaletrain.config import load_config  # noqa: E402
from scaletrain.hardware import apply_calibration, load_calibration, make_cluster  # noqa: E402
from scaletrain.plan.traced import job_row  # noqa: E402

TOLERANCE = 0.25  # issue 32: within +-25 % on CPU ranks
COMMON = [
    "precision.dtype=fp32",
    "train.eval_interval=0",
    "train.warmup_steps=0",
    "monitor.progress=false",
    "monitor.tensorboard=false",
    "monitor.sample_interval_s=0",
    "checkpoint.save_final=false",
]


def _images(work: Path, size: int, per_class: int = 64) -> Path:
    """A prepared image folder: 4 classes of noisy PNGs (their class is their mean colour); made once per `work`
    (the ViT and the UNet read the same one)."""
    import numpy as np
    from PIL import Image

    out = work / f"images{size}"
    if (out / "manifest.json").is_file():
        return out
    rng = np.random.default_rng(0)
    tree = work / f"tree{size}"
    for k, colour in enumerate([(200, 40, 40), (40, 200, 40), (40, 40, 200), (200, 200, 40)]):
        (tree / f"class{k}").mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = np.array(colour)[None, None] + rng.normal(0, 40, (size, size, 3))
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(tree / f"class{k}" / f"{i}.png")
    _cli(["data", "prepare", str(tree), "--out", str(out), "--format", "images", "--val-share", "0.1"], work)
    return out


def _clicks(work: Path) -> Path:
    from recommender import N_DENSE, N_SPARSE, _click_log

    out = work / "clicks"
    dense = ",".join(f"I{i + 1}" for i in range(N_DENSE))
    sparse = ",".join(f"C{i + 1}" for i in range(N_SPARSE))
    _cli(["data", "prepare", str(_click_log(work, 20_000, 5_000)), "--out", str(out), "--format", "tabular",
          "--dense-cols", dense, "--sparse-cols", sparse, "--val-share", "0.01"], work)  # fmt: skip
    return out


def _cli(args: list[str], cwd: Path) -> None:
    subprocess.run([sys.executable, "-m", "scaletrain.cli.main", *args], check=True, capture_output=True, cwd=cwd)


def families(work: Path) -> dict[str, Callable[[], list[str]]]:
    """name -> the job's overrides (data made in `work` on first use)."""
    return {
        "vit": lambda: ["task.name=image-classification", f"data.path={_images(work, 32)}", "model.name=vit-tiny-image",
                        "model.hidden_size=128", "model.num_hidden_layers=4", "model.num_attention_heads=4",
                        "model.intermediate_size=512", "model.patch_size=4", "train.global_batch_size=32"],
        "unet": lambda: ["task.name=diffusion", f"data.path={_images(work, 32)}", "model.name=unet-tiny-diffusion",
                         "model.sample_size=32", "model.block_out_channels=[32, 64]", "model.num_train_timesteps=100",
                         "train.global_batch_size=16"],
        "dlrm": lambda: ["task.name=recommendation", f"data.path={_clicks(work)}", "model.name=dlrm-small",
                         "train.global_batch_size=256", "train.lr=0.001"],
        "moe": lambda: ["model.name=moe-tiny", "data.seq_len=256", "data.max_bytes=1000000",
                        "train.global_batch_size=16"],
    }  # fmt: skip


def layouts(nproc: int) -> dict[str, list[str]]:
    """The data-parallel layouts a trace plans (every rank in one DP group)."""
    ddp = [f"parallel.dp_replicate={nproc}", "parallel.dp_shard=1"]
    fsdp = ["parallel.dp_replicate=1", f"parallel.dp_shard={nproc}"]
    return {
        f"ddp{nproc}": ddp,
        f"fsdp{nproc}": fsdp,
        f"ddp{nproc}_acc2": [*ddp, "train.micro_batch_size=HALF"],
        f"fsdp{nproc}_acc2": [*fsdp, "train.micro_batch_size=HALF"],
        f"ddp{nproc}_ac": [*ddp, "parallel.activation_checkpoint=full"],
    }


def _job(family: list[str], layout: list[str], nproc: int) -> list[str]:
    batch = next(int(o.split("=")[1]) for o in family if o.startswith("train.global_batch_size="))
    half = str(max(1, batch // nproc // 2))
    return [*COMMON, *family, *(o.replace("HALF", half) for o in layout)]


def measure(name: str, overrides: list[str], a, work: Path) -> dict:
    """One `scaletrain train` run; the median step of the logging windows after the first (warm-up), as
    benchmarks/layouts.py measures (a window of one step would time a metrics reduction in every step)."""
    cmd = [sys.executable, "-m", "scaletrain.cli.main", "train", *overrides, f"train.steps={a.steps}",
           f"monitor.log_interval={max(1, a.steps // 4)}", f"run.name={name}", f"run.output_dir={work / 'runs'}",
           "--nproc-per-node", str(a.nproc)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work)
    if proc.returncode != 0:
        return {"failed": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    rows = [json.loads(x) for x in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r][1:]
    return {"step_time_s": statistics.median(times), "windows": len(times)}


def predict(overrides: list[str], nproc: int, cluster) -> dict:
    row = job_row(load_config(None, overrides), nproc, cluster)
    return {"predicted_s": row.step_s, "lines": row.time, "planned": row.layout.describe()}


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--families", default="vit,unet,dlrm,moe")
    ap.add_argument("--only", default="", help="comma-separated layout names (default: all)")
    ap.add_argument("--calibration", default="", help="`scaletrain bench` TOML for the planner")
    ap.add_argument("--json", default="")
    ap.add_argument("--from-json", default="")
    ap.add_argument("--markdown", default="", help="append the table to this file")
    ap.add_argument("--work", default="", help="keep the data and runs in this folder (for --from-json later)")
    a = ap.parse_args(argv)
    cluster = make_cluster("cpu", a.nproc, gpus_per_node=a.nproc)
    if a.calibration:
        cluster = apply_calibration(cluster, load_calibration(a.calibration))
    chosen = [f for f in a.families.split(",") if f]
    known = list(families(Path()))  # the names only: no data is made until a family is called
    unknown = [f for f in chosen if f not in known]
    if unknown:
        ap.error(f"--families: unknown {unknown[0]!r}; choose from {', '.join(known)}")
    if a.from_json:  # predicted again from the same data (a run with --work keeps it)
        rows = json.loads(Path(a.from_json).read_text())
        for r in rows:
            if "step_time_s" in r:
                r |= predict(r["overrides"], a.nproc, cluster)
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=2) + "\n")
    else:
        with contextlib.ExitStack() as stack:
            work = Path(a.work) if a.work else Path(stack.enter_context(tempfile.TemporaryDirectory()))
            work.mkdir(parents=True, exist_ok=True)
            rows = measure_all(a, work, chosen, cluster)
    text = render(rows, a)
    print(text)
    if a.markdown:
        with open(a.markdown, "a") as f:
            f.write(text + "\n")
    return text


def measure_all(a, work: Path, chosen: list[str], cluster) -> list[dict]:
    """Measure, then predict (while the data exist), each family's layouts; --json rewritten after each run."""
    jobs = families(work)
    rows: list[dict] = []
    for fam in chosen:
        family = jobs[fam]()
        for name, lay in layouts(a.nproc).items():
            if a.only and name not in a.only.split(","):
                continue
            over = _job(family, lay, a.nproc)
            r = {"family": fam, "layout": name, "overrides": over, "load": os.getloadavg()[0]}
            r |= measure(f"{fam}_{name}", over, a, work)
            if "step_time_s" in r:
                r |= predict(over, a.nproc, cluster)
            print(f"  {fam} {name}: {r.get('step_time_s', r.get('failed'))}", file=sys.stderr, flush=True)
            rows.append(r)
            if a.json:
                Path(a.json).write_text(json.dumps(rows, indent=2) + "\n")
    return rows


def render(rows: list[dict], a) -> str:
    out = [
        f"{a.nproc} CPU ranks (gloo, fp32), {a.steps} steps, median step of the 4 logging windows but the first; "
        "predicted: "
        f"plan/traced.py job_row{' with ' + a.calibration if a.calibration else ' (catalog CPU placeholders)'}",
        "",
        "| family | layout | measured ms | predicted ms | error | within ±25 % | rank measured | rank predicted |",
        "|---|---|---:|---:|---:|---|---:|---:|",
    ]
    summary = []
    for fam in dict.fromkeys(r["family"] for r in rows):
        ok = [r for r in rows if r["family"] == fam and "step_time_s" in r]
        by_measured = sorted(ok, key=lambda r: r["step_time_s"])
        by_predicted = sorted(ok, key=lambda r: r["predicted_s"])
        errors = []
        for r in by_measured:
            err = r["predicted_s"] / r["step_time_s"] - 1.0
            errors.append(abs(err))
            out.append(
                f"| {fam} | {r['layout']} | {r['step_time_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} | "
                f"{err:+.1%} | {'yes' if abs(err) <= TOLERANCE else '**no**'} | {by_measured.index(r) + 1} | "
                f"{by_predicted.index(r) + 1} |"
            )
        for r in rows:
            if r["family"] == fam and "step_time_s" not in r:
                out.append(f"| {fam} | {r['layout']} | failed: {r['failed']} | | | | | |")
        if ok:
            within = sum(e <= TOLERANCE for e in errors)
            top = by_predicted[0] is by_measured[0]
            summary.append(
                f"- {fam}: {within} of {len(ok)} within ±25 %, mean |error| {statistics.mean(errors):.1%}; "
                f"measured-fastest ({by_measured[0]['layout']}) ranked {by_predicted.index(by_measured[0]) + 1} "
                f"by the planner{'' if top else ' (**not first**)'}"
            )
    return "\n".join([*out, "", *summary])


if __name__ == "__main__":
    main()
