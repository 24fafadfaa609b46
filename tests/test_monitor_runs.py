"""Monitoring end to end on 2 CPU ranks (DDP over gloo): a healthy run is not flagged and yields TensorBoard events,
device samples, profiler traces and an HTML report that headless Chromium renders without console errors; two fresh
runs in one folder, then a resume, each leave one run's samples and a report of that run; a slow data source is
diagnosed as data-loader bound; a slow rank is diagnosed as a straggler, by number.

Screenshots of the reports are kept in build/test-artifacts/."""

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import run_cli, run_cli_in_process

from scaletrain.monitor import read_jsonl
from scaletrain.monitor.faults import ENV as FAULTS

RUN = [
    "train.steps=14",
    "monitor.log_interval=2",
    "train.global_batch_size=16",
    "data.seq_len=64",
    "train.eval_batches=1",
    "data.max_bytes=300000",
    "train.warmup_steps=2",
    "monitor.progress=false",
    "parallel.dp_replicate=2",
    "train.eval_interval=0",
]


ARTIFACTS = Path(__file__).resolve().parents[1] / "build" / "test-artifacts"
# the charts a CPU run's report draws, by title
CPU_CHARTS = (
    "Loss",
    "Throughput",
    "MFU",
    "Peak memory per rank",
    "Step time breakdown (rank mean)",
    "Busy time per rank (straggler check)",
    "CPU host: process CPU per rank (no GPU)",
    "CPU host: resident memory per rank (no GPU)",
)


def diagnosis(run):
    return json.loads((run / "monitor" / "diagnosis.json").read_text())


def flags(run):
    return [f for f in diagnosis(run) if f["severity"] != "info"]


def chromium(args: list[str], tmp_path, timeout=120) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium")
    if exe is None:
        pytest.skip("chromium not installed (tests/browser/install.sh installs it)")
    return subprocess.run(
        [
            exe,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'chromium-profile'}",
            "--enable-logging=stderr",
            "--v=0",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def console_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if re.search(r"CONSOLE[:(]", line)]


def series_xs(html: str) -> dict[str, list[float]]:
    """Each drawn series' x positions (SVG units, left to right), in the order the report drew its points."""
    out = {}
    for gid, body in re.findall(r'<g id="(series-\d+-\d+)">(.*?)(?=<g id="|</svg>)', html, re.S):
        uses = re.findall(r'<use [^>]*\bx="([-\d.e]+)"', body)
        line = re.search(r'<path d="([^"]+)"', body)
        out[gid] = [float(x) for x in uses] if uses else [float(x) for x in re.findall(r"[ML] ([-\d.e]+) ", line[1])]
    return out


def render_report(run: Path, tmp_path: Path, name: str) -> str:
    """`scaletrain report RUN`, checked as a user opens it: every chart drawn, every series in time order, no
    placeholder figure, no console errors in Chromium; the screenshot is kept as build/test-artifacts/NAME.png."""
    out = run_cli_in_process(["report", str(run)], tmp_path).stdout.strip()
    assert out == str(run / "report.html")
    html = (run / "report.html").read_text()
    assert re.findall(r'<figure class="chart" aria-label="([^"]+)"', html) == list(CPU_CHARTS)
    assert "placeholder" not in html.lower()
    drawn = series_xs(html)
    assert drawn and all(xs and xs == sorted(xs) for xs in drawn.values()), drawn
    shot = tmp_path / f"{name}.png"
    page = chromium([f"--screenshot={shot}", "--window-size=1280,2200", (run / "report.html").as_uri()], tmp_path)
    assert shot.is_file() and shot.stat().st_size > 30_000, page.stderr[-2000:]
    assert console_lines(page.stderr) == []
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shot, ARTIFACTS / shot.name)
    return html


def sample_times(run: Path) -> dict[int, list[float]]:
    return {r: [s["t"] for s in read_jsonl(run / "monitor" / f"samples_rank{r}.jsonl")] for r in (0, 1)}


def increasing(ts: list[float]) -> bool:
    return all(a < b for a, b in zip(ts, ts[1:]))


@pytest.mark.slow  # three launches; one launch's samples, TensorBoard, profile and report stay fast (the healthy run)
def test_two_fresh_runs_then_a_resume_keep_one_run_and_report_it(tmp_path):
    run = tmp_path / "runs" / "again"
    again = [*RUN, "run.name=again", "monitor.sample_interval_s=0.2", "train.steps=6", "train.eval_interval=4"]
    run_cli(["train", *again], tmp_path)
    first = json.loads((run / "monitor" / "run.json").read_text())
    (run / "profile").mkdir()  # what an earlier run may leave that this one does not write
    # the same command again: no checkpoint, so a fresh run; it saves one at its end for the resume below
    run_cli(["train", *again, "checkpoint.save_final=true"], tmp_path)
    second = json.loads((run / "monitor" / "run.json").read_text())
    assert second["started_at"] > first["started_at"] and len(second["attempts"]) == 1
    assert not (run / "profile").exists()
    times = sample_times(run)
    for ts in times.values():  # only the second run's samples: counted from its start, never back in time
        assert ts and increasing(ts) and ts[-1] < time.time() - second["started_at"]
    html = render_report(run, tmp_path, "report_two_fresh_runs")
    assert ">attempts</th><td>1<" in html

    run_cli(["train", *again, "train.steps=10"], tmp_path)  # resumes at step 6
    resumed = json.loads((run / "monitor" / "run.json").read_text())
    assert resumed["started_at"] == second["started_at"]
    assert [a["start_step"] for a in resumed["attempts"]] == [0, 6]
    for rank, ts in sample_times(run).items():  # the first attempt's samples, then the resume's, later in time
        assert ts[: len(times[rank])] == times[rank] and len(ts) > len(times[rank]) and increasing(ts)
        assert ts[len(times[rank])] > resumed["attempts"][1]["t_s"]
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    assert steps == [2, 4, 6, 8, 10]
    html = render_report(run, tmp_path, "report_resumed_run")
    assert ">attempts</th><td>2<" in html and "at step 6" in html
    assert ">restart<" in html  # the restart is marked (and named in the legends)


def test_healthy_run_tensorboard_profile_samples_and_report_in_chromium(tmp_path):
    proc = run_cli(
        ["train", *RUN, "run.name=healthy", "monitor.sample_interval_s=0.2", "monitor.profile_at_step=5"], tmp_path
    )
    run = tmp_path / "runs" / "healthy"
    assert flags(run) == [], diagnosis(run)
    assert "diagnosis: no bottleneck found" in proc.stderr
    assert re.search(r"step 4/14 .* MFU [\d.]+% +step \d+ ms \(data \d+%, comm \d+%\)", proc.stderr)

    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    for key in (
        "mfu",
        "time_data_s",
        "time_forward_s",
        "time_backward_s",
        "time_comm_s",
        "time_optimizer_s",
        "straggler_spread",
    ):
        assert all(r[key] >= 0 for r in rows), key
    assert all(len(r["peak_mem_bytes_per_rank"]) == 2 and min(r["peak_mem_bytes_per_rank"]) > 1e7 for r in rows)
    assert rows[-1]["comm_measure"] == "grad-ready hooks"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {
        "loss/train",
        "loss/val",
        "optim/grad_norm",
        "optim/lr",
        "throughput/tokens_per_s",
        "throughput/mfu",
        "time/data_s",
        "time/forward_s",
        "time/backward_s",
        "time/comm_s",
        "time/optimizer_s",
        "ranks/straggler_spread",
        "memory/peak_bytes/rank0",
        "memory/peak_bytes/rank1",
    } <= tags
    assert [e.step for e in acc.Scalars("loss/train")] == [r["step"] for r in rows]
    assert acc.Scalars("loss/train")[-1].value == pytest.approx(rows[-1]["loss"], rel=1e-6)

    for rank in (0, 1):  # CPU host: labelled CPU samples, no GPU figures
        samples = read_jsonl(run / "monitor" / f"samples_rank{rank}.jsonl")
        assert samples and all(s["kind"] == "cpu" and s["rss_bytes"] > 0 for s in samples)
        trace = json.loads((run / "profile" / f"rank{rank}_step5.pt.trace.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert "scaletrain.forward" in names and "scaletrain.backward" in names
    top = [f for f in diagnosis(run) if f["rule"] == "top_kernels"]
    assert top and "aten::" in top[0]["evidence"]

    html = render_report(run, tmp_path, "report_default_job")
    assert "No bottleneck found" in html and "measured on this host" in html
    # the capture above is live: a page that does log an error is caught
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><script>console.error('report-test-probe')</script></body></html>")
    probe = chromium(["--dump-dom", bad.as_uri()], tmp_path)
    assert any("report-test-probe" in line for line in console_lines(probe.stderr))


@pytest.mark.slow  # a launch; the rule is unit-tested in test_monitor_diagnosis.py
def test_slow_data_source_is_diagnosed_as_data_loader_bound(tmp_path):
    # the fault reaches the ranks only through the launcher passing the environment on. Its size: a step of this job
    # takes ~0.3 s alone and over 1 s while another test's ranks share the 2 cores (`pytest -n auto`); 60 ms of data
    # wait fell under the 10 % threshold there, 400 ms does not
    run_cli(
        ["train", *RUN, "run.name=slowdata", "monitor.sample_interval_s=0"], tmp_path, env={FAULTS: "data_delay_ms=400"}
    )
    got = flags(tmp_path / "runs" / "slowdata")
    assert [f["rule"] for f in got] == ["data_loader_bound"], got


@pytest.mark.slow  # a launch; the rule is unit-tested in test_monitor_diagnosis.py
def test_slow_rank_is_diagnosed_as_straggler_naming_it(tmp_path):
    # 500 ms more per step on rank 1: above the 15 % threshold even when a shared host slows every step to ~2 s
    proc = run_cli(
        ["train", *RUN, "run.name=slowrank", "monitor.sample_interval_s=0"],
        tmp_path,
        env={FAULTS: "slow_rank=1,slow_rank_ms=500"},
    )
    got = flags(tmp_path / "runs" / "slowrank")
    assert [f["rule"] for f in got] == ["straggler"] and got[0]["ranks"] == [1], got
    assert "Straggling rank: rank 1" in proc.stderr


def test_fault_injection_is_an_environment_variable_refused_in_one_line_when_malformed():
    from scaletrain.config import ConfigError, load_config
    from scaletrain.monitor.faults import injected_delays

    assert injected_delays(0, {}) == {}
    assert injected_delays(1, {FAULTS: "data_delay_ms=50, slow_rank=1,slow_rank_ms=80"}) == {
        "data": 0.05,
        "forward": 0.08,
        "fb": 0.08,
    }
    assert injected_delays(0, {FAULTS: "slow_rank=1,slow_rank_ms=80"}) == {}
    for bad, named in [
        ("data_delay=5", "'data_delay=5'"),
        ("data_delay_ms=-1", "data_delay_ms"),
        ("slow_rank=one,slow_rank_ms=5", "slow_rank"),
        ("slow_rank_ms=80", "go together"),
        ("data_delay_ms=nan", "data_delay_ms"),
        ("data_delay_ms", "'data_delay_ms'"),
    ]:
        with pytest.raises(ValueError) as e:
            injected_delays(0, {FAULTS: bad})
        assert str(e.value).startswith(f"{FAULTS}: ") and named in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="monitor.fault_data_delay_ms"):  # no longer a config field
        load_config(None, ["monitor.fault_data_delay_ms=60"])


def test_without_a_known_peak_there_is_no_mfu_and_the_report_says_how_to_get_one(tmp_path, monkeypatch):
    import torch

    from scaletrain.monitor import throughput
    from scaletrain.monitor.report import build_report

    def no_probe(device, dtype, seconds=0.3):
        raise RuntimeError("probe out of memory")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(throughput, "probe_matmul_flops", no_probe)
    peak, why = throughput.peak_flops(torch.device("cpu"), "fp32", 2)
    assert peak is None and "probe out of memory" in why and "next run" in why

    run = tmp_path / "runs" / "nopeak"
    (run / "monitor").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 900.0}) + "\n" for s in (2, 4, 6))
    )
    (run / "monitor" / "meta.json").write_text(json.dumps({"device": "cpu", "peak_source": why}))
    html = build_report(run)
    assert "MFU —" in html and 'aria-label="MFU"' not in html and "placeholder" not in html.lower()
