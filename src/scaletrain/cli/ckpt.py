"""`scaletrain ckpt ls|verify|export`: look into, check and convert a run's checkpoints."""

from __future__ import annotations

import datetime
import shutil
from pathlib import Path

import click

from scaletrain.checkpoint.manifest import (
    MANIFEST,
    list_checkpoints,
    partial_dirs,
    read_manifest,
    set_aside_dirs,
    verify,
)
from scaletrain.cli.errors import fail
from scaletrain.exit_codes import EXIT_FAILED


def _root(path: Path) -> Path:
    """Accept a run folder, its checkpoints/ folder, or one checkpoint; return the folder holding step_* dirs."""
    if not path.exists():
        fail(f"{path}: no such folder; pass a run folder (runs/NAME) or its checkpoints/ folder")
    if (path / MANIFEST).is_file() or path.name.startswith("step_"):
        return path.parent
    if (path / "checkpoints").is_dir():
        return path / "checkpoints"
    return path


def _targets(path: Path) -> list[Path]:
    if (path / MANIFEST).is_file() or path.name.startswith("step_"):
        return [path]
    root = _root(path)
    found = list_checkpoints(root)
    if not found:
        fail(f"{path}: holds no checkpoints (no step_NNNNNNNN folders)")
    return found


@click.group()
def ckpt() -> None:
    """Inspect, verify and export checkpoints."""


@ckpt.command("ls")
@click.argument("path", type=click.Path(path_type=Path))
@click.option(
    "--verify",
    "deep",
    is_flag=True,
    help="Also read every file against its sha256 and check the metadata (slow for large checkpoints).",
)
def ls_cmd(path: Path, deep: bool) -> None:
    """List checkpoints: step, time, size, layout, world size, status.

    Without --verify the status is from file sizes only and says so ("sizes ok, not verified"); with it,
    "verified" means every sha256 matched and the metadata holds nothing but checkpoint classes.
    """
    root = _root(path)
    rows = []
    for p in list_checkpoints(root):
        m = read_manifest(p)
        verdict = verify(p, checksums=deep)
        when = datetime.datetime.fromtimestamp(m["time"]).strftime("%Y-%m-%d %H:%M:%S") if m else "-"
        good = "verified (sha256, metadata)" if deep else "sizes ok, not verified (ckpt verify)"
        rows.append(
            (
                p.name,
                str(m["step"]) if m else "?",
                when,
                f"{m['bytes'] / 1e6:.1f} MB" if m else "-",
                m.get("layout", "-") if m else "-",
                str(m.get("world_size", "-")) if m else "-",
                good if verdict.ok else f"BAD: {verdict.problem}",
            )
        )
    for p in set_aside_dirs(root):
        rows.append(
            (
                p.name,
                p.name[5:13].lstrip("0") or "0",
                "-",
                "-",
                "-",
                "-",
                "set aside: failed verification when a resume looked at it; never loaded",
            )
        )
    for p in partial_dirs(root):
        rows.append((p.name, "?", "-", "-", "-", "-", "incomplete (never committed)"))
    if not rows:
        fail(f"{path}: holds no checkpoints")
    head = ("checkpoint", "step", "saved", "size", "layout", "world", "status")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


@ckpt.command("verify")
@click.argument("path", type=click.Path(path_type=Path))
def verify_cmd(path: Path) -> None:
    """Check every file of each checkpoint against its sha256, and that its metadata holds nothing but checkpoint
    classes (nothing is unpickled otherwise); exit 1 if any is bad."""
    bad = 0
    for p in _targets(path):
        verdict = verify(p, checksums=True)
        click.echo(f"{p.name}: {'ok' if verdict.ok else 'BAD: ' + verdict.problem}")
        bad += not verdict.ok
    if bad:
        fail(f"{bad} checkpoint(s) failed verification", code=EXIT_FAILED)


@ckpt.command("export")
@click.argument("path", type=click.Path(path_type=Path))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["safetensors", "hf", "peft", "diffusers", "torch"]),
    default="safetensors",
    show_default=True,
    help="safetensors: the model's own parameter names; hf: a folder transformers' from_pretrained loads (config.json, "
    "safetensors in transformers' names and layout; a LoRA run's adapters merged into its base); peft: a LoRA run's "
    "adapter folder peft.PeftModel.from_pretrained loads; diffusers: a diffusion model's pipeline folder "
    "DiffusionPipeline.from_pretrained loads; torch: one model.pt.",
)
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Folder to write (created).")
@click.option(
    "--max-shard-size",
    default="2GB",
    show_default=True,
    help="safetensors/hf: largest output file (e.g. 500MB, 1GiB); several come with model.safetensors.index.json. "
    "Export holds about one such file in memory, never the whole model.",
)
def export_cmd(path: Path, fmt: str, out: Path, max_shard_size: str) -> None:
    """Convert a checkpoint (default: the newest good one) into a file set others load."""
    from scaletrain.checkpoint.export import export_checkpoint, parse_size

    try:
        shard_bytes = parse_size(max_shard_size)
    except ValueError as e:
        fail(str(e))

    target = None
    for p in _targets(path):
        verdict = verify(p, checksums=True)
        if verdict.ok:
            target = p
            break
        click.echo(f"skipping {p.name}: {verdict.problem}", err=True)
    if target is None:
        fail(f"{path}: no checkpoint passes verification")
    if out.exists() and any(out.iterdir()):
        fail(f"--out: {out} exists and is not empty; choose a new folder")
    # written beside --out and renamed into place at the end: an export that fails leaves nothing half-written
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        written = export_checkpoint(target, staging, fmt, shard_bytes)
    except ValueError as e:
        shutil.rmtree(staging, ignore_errors=True)
        fail(str(e))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    staging.replace(out)  # out is absent or an empty folder
    for f in written:
        click.echo(f"wrote {out / (f.relative_to(staging) if f.is_relative_to(staging) else f.name)}")
