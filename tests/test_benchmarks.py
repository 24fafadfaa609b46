"""Benchmarks are not tests: only check that each script runs end to end (2 steps)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # runs the trainer and plain loops; what they run is tested in the trainer's own tests
def test_overhead_benchmark_runs():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/overhead.py"), "--reps", "1", "--steps", "2", "--log-every", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "plain torch" in proc.stdout and "scaletrain" in proc.stdout


@pytest.mark.slow  # launches; the planner's memory formulas are test_plan_distributed.py's
def test_memory_benchmark_runs(tmp_path):
    """Two variants of a miniature model, 1 step each; the table and its BENCHMARKS.md section render."""
    report = tmp_path / "BENCHMARKS.md"
    report.write_text("# Benchmarks\n")
    argv = ["--dim", "64", "--layers", "1", "--vocab", "256", "--seq-len", "32", "--steps", "1"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/memory.py"), *argv, "--variants", "baseline,unsharded"]
        + ["--markdown", str(report)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| baseline |" in proc.stdout and "| unsharded |" in proc.stdout
    assert "## Memory options: accumulation, offload, activations" in report.read_text()


def test_cli_startup_benchmark_runs(tmp_path):
    """One rep of every command; the table has a row for each and the report lands in its own section."""
    report = tmp_path / "BENCHMARKS.md"
    report.write_text("# Benchmarks\n\n## Notes\n\nhand-written\n")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/cli_startup.py"), "--reps", "1", "--markdown", str(report)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for row in (
        "python -c pass",
        'python -c "import torch"',
        "scaletrain --help",
        "scaletrain models",
        "scaletrain ckpt ls RUN",
        "scaletrain plan --model llama-8b --gpus 8",
    ):
        assert f"| `{row}` |" in proc.stdout
    text = report.read_text()
    assert text.startswith("# Benchmarks\n\n## Notes\n\nhand-written\n")
    assert "## CLI start-up: time to answer" in text and "| `scaletrain --help` |" in text


@pytest.mark.slow
def test_peers_benchmark_runs(tmp_path):
    """Every runner (scaletrain DDP/FSDP, torch DDP/FSDP2, Accelerate, Fabric; and the HF Llama rows) trains 2 steps
    and the report renders. One 64-token sequence per rank and step, from FAST's 300 kB of text: every runner's code
    path runs as at the defaults (16 x 256 tokens from 1 MB), at a fraction of the compute."""
    report = tmp_path / "BENCHMARKS.md"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/peers.py"),
            "--reps",
            "1",
            "--steps",
            "2",
            "--seq-len",
            "64",
            "--global-batch",
            "2",
            "--max-bytes",
            "300000",
            "--log-every",
            "1",
            "--markdown",
            str(report),
            "--cprofile",
            "1:2",
            "--ops",
            "1:2",
            "--profile-dir",
            str(tmp_path / "prof"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for runner in (
        *("scaletrain-ddp", "torch-ddp", "accelerate-ddp", "fabric-ddp", "scaletrain-fsdp", "torch-fsdp2"),
        *("scaletrain-hf-fsdp", "scaletrain-hf-ddp", "accelerate-hf-ddp", "fabric-hf-ddp"),
    ):
        assert f"| {runner} |" in proc.stdout
        assert (tmp_path / "prof" / f"{runner}.pstats").is_file()  # rank 0's profile of step 2, every runner
    assert "own time ms/step" in proc.stdout
    assert "scaletrain-fsdp vs torch-fsdp2" in proc.stdout and "aten::mm" in proc.stdout  # --ops: op tables
    assert "| torch-ddp |" in report.read_text() and "benchmarks/peers.py" in report.read_text()


@pytest.mark.slow  # launches; checkpointing is test_checkpoint.py's
def test_checkpoint_benchmark_runs(tmp_path):
    """Sync and async saves, restores and a SIGKILL recovery of the real CLI on a ~2 MB model; the report renders
    into its own section and leaves the rest of the file alone. Figures only need to exist and be positive."""
    report = tmp_path / "BENCHMARKS.md"
    report.write_text("# Benchmarks\n\n## Notes\n\nhand-written\n")
    tiny = "tiny:dim=64:n_layers=1"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/checkpoint.py"),
            "--models",
            tiny,
            "--reps",
            "1",
            "--recovery-model",
            tiny,
            "--interval",
            "2",
            "--kill-at",
            "5",
            "--restart-modes",
            "process,replicas",  # replicas runs the in-process launcher too
            "--memory-interval",
            "1",
            "--parts",
            "stall,recovery,goodput",
            "--goodput-s",
            "3",
            "--kill-every-s",
            "1.5",
            "--markdown",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()

    def numbers(row: str) -> list[float]:
        cells = [c.replace(",", "") for c in row.strip("| ").split(" | ")[1:]]
        return [float(c) for c in cells if c.replace(".", "", 1).isdigit()]

    stall, throughput = [row for row in lines if row.startswith(f"| {tiny} |")]  # one row in each table
    got = numbers(stall)  # staging and write waits may round to 0 ms: the async write is off the step
    assert len(got) == 11 and all(x >= 0 for x in got) and got[1] > 0 and got[5] > 0, stall
    assert len(numbers(throughput)) == 7 and all(x > 0 for x in numbers(throughput)), throughput
    restore = next(row for row in lines if row.startswith("| restore (sha256 verify + DCP load) |"))
    total = next(row for row in lines if row.startswith("| **total**"))
    # columns: fresh start, recovery (a fresh start restores nothing: its restore may round to 0.00)
    assert numbers(restore)[1] > 0 and numbers(total)[0] > 0 and numbers(total)[1] > 0, (restore, total)
    # goodput: each mode's run against an undisturbed run of its layout (replicas: DDP 2); columns kills, steps,
    # goodput (the clock starts at the first step: every run has trained at least that one)
    good = {row.split(" | ")[0].strip("| "): numbers(row) for row in lines if row.count(" | ") == 3}
    assert good["undisturbed"][0] == 0 and good["undisturbed"][2] == 1.0, good
    assert good["undisturbed (parallel.dp_replicate=2)"][2] == 1.0, good
    assert good["launch.restart=process"][0] >= 1 and good["launch.restart=process"][1] >= 1, good
    replicas = next(v for k, v in good.items() if "launch.fault_tolerance=replicas" in k)
    assert replicas[0] >= 1 and replicas[1] >= 1, good
    side = [row for row in lines if "kill → next metrics row" in row]
    assert len(side) == 2 and "launch.fault_tolerance=replicas" in side[1] and numbers(side[1])[0] > 0, side
    text = report.read_text()
    assert text.startswith("# Benchmarks\n\n## Notes\n\nhand-written\n")
    assert "## Checkpoints: save stall, throughput, recovery" in text and "| **total**" in text


@pytest.mark.slow  # prepares data; test_data_prepare.py
def test_data_prepare_benchmark_runs(tmp_path):
    """Both sides (scaletrain prepare, datasets load + map) on a tiny corpus: same token count, the table renders."""
    pytest.importorskip("datasets")
    report = tmp_path / "BENCHMARKS.md"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/data_prepare.py"),
            "--mb",
            "0.3",
            "--reps",
            "1",
            "--markdown",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| scaletrain `data prepare` |" in proc.stdout and "| datasets `map` alone |" in proc.stdout
    assert "## Data prepare: tokens/s against datasets.map" in report.read_text()


@pytest.mark.slow  # launches; fp8 conversion is test_fp8.py's
def test_fp8_benchmark_runs(tmp_path):
    """bf16 and emulated fp8 on 2 CPU ranks, 2 steps each: the loss table and the labelled ratio print."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/fp8.py"), "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "worst step loss difference" in proc.stdout and "emulated on CPU, not a speed figure" in proc.stdout


def test_gpu_planner_dry_run_checks_arguments_without_a_gpu(tmp_path, capsys):
    """benchmarks/gpu_planner.py's CPU side: --dry-run prints the bench and train commands with the planner's
    predictions; bad arguments are one line, exit 2 (the GPU measurement itself runs only on a lent GPU)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_planner", ROOT / "benchmarks/gpu_planner.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    mod.main(["--dry-run", "--out", str(tmp_path / "o"), "--runs", "none:1,full:4:compile", "--gpu", "h200"])
    out = capsys.readouterr().out
    assert "bench --nproc 1" in out and "parallel.activation_checkpoint=full" in out
    assert "[none-mb1: predicted" in out and "[full-mb4-compile: predicted" in out and "parallel.compile=true" in out
    assert not (tmp_path / "o").exists()  # a dry run writes nothing
    for bad in (["--runs", "most:1"], ["--runs", "none:0"], ["--steps", "1"], ["--gpu", "nope"]):
        with pytest.raises(SystemExit) as exit_:
            mod.main(["--dry-run", *bad])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert exit_.value.code == 2 and "error:" in err, (bad, err)


def test_gpu_check_dry_run_lists_every_figure_and_the_trainer_accepts_each_config(tmp_path, capsys):
    """benchmarks/gpu_check.py's CPU side: --dry-run prints one `scaletrain train` per figure of issue 34 (bf16
    compiled at fp8's micro-batch included); every config but the refused eager fp8 passes the trainer's own
    checks, so no GPU time goes to a refused run."""
    import importlib.util

    from scaletrain.config import load_config
    from scaletrain.resolve import resolve_job

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks/gpu_check.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    mod.main(["--dry-run", "--out", str(tmp_path / "o")])
    lines = capsys.readouterr().out.strip().splitlines()
    names = [x.split("run.name=")[1].split()[0] for x in lines]
    assert {"bf16-compile-mb8", "fp8-tensorwise-compile-mb8", "fp8-tensorwise-eager-mb4", "default"} <= set(names)
    assert lines[names.index("fp8-tensorwise-eager-mb4")].startswith("[refused]")
    assert not (tmp_path / "o").exists()  # a dry run writes nothing
    for make in mod.RUNS:
        run = make(mod.argparse.Namespace(steps=30, seq_len=2048))
        if not run.refused:
            resolve_job(load_config(None, list(run.settings)), 1)
    with pytest.raises(SystemExit) as exit_:
        mod.main(["--dry-run", "--steps", "3"])
    assert exit_.value.code == 2


@pytest.mark.slow  # QLoRA itself is test_lora.py's
def test_qlora_gpu_check_runs_its_cuda_path_on_the_cpu():
    """benchmarks/qlora_gpu_check.py --device cpu: the parity half compares the CPU with itself (0 apart), and both
    variants train; the 4-bit base is smaller than the fp32 one."""
    argv = ["--device", "cpu", "--dim", "256", "--layers", "1", "--seq", "64", "--rows", "2", "--steps", "1"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/qlora_gpu_check.py"), *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["loss_abs_diff"] == 0.0 and out["adapter_grad_max_abs_diff"] == 0.0
    assert out["qlora"]["base_bytes"] < out["lora"]["base_bytes"] and out["qlora"]["tokens_per_s"] > 0


@pytest.mark.slow  # two 2-rank launches; what the planner prices is tests/test_plan_shared_cpu.py's
def test_planner_families_benchmark_measures_predicts_and_predicts_again(tmp_path):
    """A ViT under DDP 2 and FSDP 2, 4 steps each: a measured and a predicted time per row, the table, and the same
    predictions again from --json's rows (the data kept by --work)."""
    rows, work = tmp_path / "rows.json", tmp_path / "work"
    script = [sys.executable, str(ROOT / "benchmarks/planner_families.py"), "--nproc", "2"]
    run = [
        *script,
        "--steps",
        "4",
        "--families",
        "vit",
        "--only",
        "ddp2,fsdp2",
        "--json",
        str(rows),
        "--work",
        str(work),
    ]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(rows.read_text())
    assert [r["layout"] for r in measured] == ["ddp2", "fsdp2"]
    assert all(r["step_time_s"] > 0 and r["predicted_s"] > 0 for r in measured), measured
    assert "| vit | ddp2 |" in proc.stdout and "- vit: " in proc.stdout
    again_rows = tmp_path / "again.json"
    again = subprocess.run(
        [*script, "--steps", "4", "--from-json", str(rows), "--json", str(again_rows)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    for first, second in zip(measured, json.loads(again_rows.read_text()), strict=True):
        assert second["step_time_s"] == first["step_time_s"]
        # a trace in another process may count a few ops more or less (1 % seen): the same plan, not the same bits
        assert second["predicted_s"] == pytest.approx(first["predicted_s"], rel=0.05)
