"""Importing a Hugging Face folder's weights, measured: peak memory per rank while 2 FSDP ranks load a sharded
safetensors folder, against the full model's size; and exporting a checkpoint of it back (`scaletrain ckpt export`).

    python benchmarks/hf_import.py                       # ~430 MB fp32 Llama in 4 shards, 2 CPU ranks
    python benchmarks/hf_import.py --markdown BENCHMARKS.md
    python benchmarks/hf_import.py --layers 2 --vocab 4000   # a quick check

The script writes a random transformers Llama (config.json + 4 safetensors shards + their index, tensor by tensor,
so writing never holds the model either), then builds it on 2 gloo ranks under FSDP2 twice, one torchrun launch
each, side by side:
- sliced: `model.hf=FOLDER`, each rank reading only its shard of every tensor (models/hf/weights.py);
- whole: the same model filled from the full state every rank reads (safetensors load_file of every shard, then
  torch's set_model_state_dict(full_state_dict=True): what checkpoint.init_from_hf does for the built-in Llama).
Each rank reports its resident memory before building (torch and transformers imported) and its peak (VmHWM)
after; the growth is what loading cost.

Export: one training step of that model (`scaletrain train model.hf=FOLDER`, 1 rank) saves a DCP checkpoint, then
one fresh process per row runs the export `scaletrain ckpt export` runs (checkpoint/export.py) and reports the same
growth: `--format hf` streamed with the default --max-shard-size (2GB: here one file, the whole model) and with
100MB shards, and `--format torch`, which consolidates the model in memory (the baseline). Everything is deleted
afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ helpers import each other by name

SECTION = "## Hugging Face import: peak memory per rank vs the model"


def status_mib() -> dict[str, float]:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {k: int(status[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}


def write_folder(folder: Path, layers: int, vocab: int, shards: int) -> int:
    """A random Llama saved as transformers saves it, written tensor by tensor; returns its bytes."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from scaletrain.models.hf.spec import HFSpec

    cfg = AutoConfig.for_model(
        "llama",
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=vocab,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    folder.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(folder)
    shapes = {n: tuple(t.shape) for n, t in HFSpec.from_folder(str(folder)).meta_model.state_dict().items()}
    total = sum(4 * torch.Size(s).numel() for s in shapes.values())
    weight_map: dict[str, str] = {}
    part: dict[str, torch.Tensor] = {}
    index, size = 1, 0
    gen = torch.Generator().manual_seed(0)

    def flush() -> None:
        nonlocal part, index, size
        name = f"model-{index:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
        part, index, size = {}, index + 1, 0

    for name, shape in shapes.items():
        part[name] = torch.randn(shape, generator=gen) * 0.02
        size += part[name].numel() * 4
        if size >= total / shards and index < shards:
            flush()
    if part:
        flush()
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=1))
    return total


def worker(folder: Path, mode: str, out: Path) -> None:
    """One rank: build the model under FSDP2 (2 ranks) from the folder; write memory before and after."""
    import torch.distributed as dist

    from scaletrain.checkpoint.export import load_hf_weights
    from scaletrain.config import load_config
    from scaletrain.models.spec import init_by_name
    from scaletrain.parallel import init_distributed, shutdown_distributed
    from scaletrain.parallel.dims import build_mesh
    from scaletrain.resolve import resolve_job
    from scaletrain.train.trainer import build_model

    rt = init_distributed("cpu")
    cfg = load_config(None, [f"model.hf={folder}", "data.seq_len=128"])
    resolved = resolve_job(cfg, rt.world_size)
    mesh = build_mesh(resolved.layout, "cpu")
    spec = resolved.spec
    before = status_mib()
    if mode == "sliced":
        model = build_model(cfg, resolved, mesh, rt).module
    else:
        from scaletrain.parallel.apply import ParallelPlan, apply_parallelism

        def fill(m):
            spec.init_buffers(m)
            init_by_name(m, 0, spec.param_init_std)

        plan = ParallelPlan(resolved.layout, cfg.parallel, cfg.precision, spec)
        model = apply_parallelism(spec.build("meta"), plan, mesh, rt.device, fill).module
        load_hf_weights(model, folder, spec)
    after = status_mib()
    local = sum(p.to_local().numel() * 4 for p in model.parameters())  # type: ignore[operator]
    record = {"before": before["VmRSS"], "peak": after["VmHWM"], "after": after["VmRSS"], "local_mib": local / 2**20}
    (out / f"{mode}_rank{rt.rank}.json").write_text(json.dumps(record))
    dist.barrier()
    shutdown_distributed()


EXPORTS = {"hf, 2GB shards (default)": ("hf", "2GB"), "hf, 100MB shards": ("hf", "100MB"), "torch": ("torch", "2GB")}


def export_worker(ckpt: Path, label: str, out: Path) -> None:
    """One process: export the checkpoint as row `label` does; write memory before and after."""
    import huggingface_hub.serialization  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    from scaletrain.checkpoint.export import export_checkpoint, manifest_spec, read_manifest

    fmt, shard = EXPORTS[label]
    # what every export loads whatever the model's size (modules, transformers' meta model and conversion
    # mapping), loaded before measuring, and the high-water mark reset: the growth is what the weights cost
    hf = manifest_spec(read_manifest(ckpt) or {}).hf
    assert hf is not None
    hf.to_hf({})
    Path("/proc/self/clear_refs").write_text("5")
    before = status_mib()
    written = export_checkpoint(ckpt, out / "exported", fmt, shard)
    after = status_mib()
    files = [f for f in written if f.suffix in (".safetensors", ".pt")]
    record = {"before": before["VmRSS"], "peak": after["VmHWM"], "files": len(files)}
    record["largest_mib"] = max(f.stat().st_size for f in files) / 2**20
    (out / "export.json").write_text(json.dumps(record))


def measure_exports(folder: Path, root: Path) -> dict[str, dict]:
    """Train one step from the folder (one rank, checkpoint saved), then export it once per row."""
    import shutil

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    train = [sys.executable, "-m", "scaletrain.cli.main", "train", f"model.hf={folder}", "run.name=export"]
    train += ["train.steps=1", "data.seq_len=32", "train.global_batch_size=2", "train.eval_batches=1"]
    train += ["checkpoint.save_final=true", "monitor.progress=false", "data.max_bytes=300000", "--nproc-per-node", "1"]
    proc = subprocess.run(train, capture_output=True, text=True, cwd=root, env=env)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    ckpt = next((root / "runs/export/checkpoints").glob("step_*"))
    rows = {}
    for label in EXPORTS:
        work = root / "export_work"
        work.mkdir()
        cmd = [sys.executable, __file__, "--export-worker", str(ckpt), label, str(work)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode:
            raise SystemExit(proc.stderr[-3000:])
        rows[label] = json.loads((work / "export.json").read_text())
        shutil.rmtree(work)
    return rows


def launch(folder: Path, mode: str, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d"]
    cmd += ["--rdzv-endpoint", "127.0.0.1:0", __file__, "--worker", str(folder), mode, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return [json.loads((out / f"{mode}_rank{r}.json").read_text()) for r in range(2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--markdown", type=Path, help="replace this file's section with the results")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--export-worker", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(Path(a.worker[0]), a.worker[1], Path(a.worker[2]))
        return
    if a.export_worker:
        export_worker(Path(a.export_worker[0]), a.export_worker[1], Path(a.export_worker[2]))
        return
    with tempfile.TemporaryDirectory(prefix="hf_import_") as tmp:
        root = Path(tmp)
        total = write_folder(root / "model", a.layers, a.vocab, a.shards)
        full = total / 2**20
        print(f"model: {full:.0f} MiB fp32 in {a.shards} safetensors shards", flush=True)
        rows = []
        for mode in ("sliced", "whole"):
            recs = launch(root / "model", mode, root)
            rows.append((mode, recs))
            grow = " / ".join(f"{r['peak'] - r['before']:.0f}" for r in recs)
            print(f"{mode}: peak growth per rank (MiB) {grow}; full model {full:.0f} MiB", flush=True)
        exports = measure_exports(root / "model", root)
        for label, rec in exports.items():
            print(f"export {label}: peak growth {rec['peak'] - rec['before']:.0f} MiB; full model {full:.0f} MiB")
    report = [
        f"A random Llama, {full:.0f} MiB fp32 ({a.layers} layers, hidden 1024, vocabulary {a.vocab}) in {a.shards} "
        "safetensors shards, built under FSDP2 on 2 CPU ranks.",
        "",
        "| load | RSS before (MiB) | peak RSS (MiB) | peak growth (MiB) | growth / full model | this rank's shard (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for mode, recs in rows:
        for r, rec in enumerate(recs):
            grow = rec["peak"] - rec["before"]
            report.append(
                f"| {mode}, rank {r} | {rec['before']:.0f} | {rec['peak']:.0f} | {grow:.0f} | {grow / full:.2f} | "
                f"{rec['local_mib']:.0f} |"
            )
    report += [
        "",
        "`scaletrain ckpt export` of a checkpoint of the same model (one training step, 1 rank), one fresh process "
        "per row:",
        "",
        "| export | RSS before (MiB) | peak RSS (MiB) | peak growth (MiB) | growth / full model | files | largest (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, rec in exports.items():
        grow = rec["peak"] - rec["before"]
        report.append(
            f"| {label} | {rec['before']:.0f} | {rec['peak']:.0f} | {grow:.0f} | {grow / full:.2f} | {rec['files']} | "
            f"{rec['largest_mib']:.0f} |"
        )
    report.append("")
    print("\n".join(report))
    if a.markdown:
        import sections
        from peers import machine

        sections.write_section(a.markdown, SECTION, "benchmarks/hf_import.py", None, report, machine())


if __name__ == "__main__":
    main()
