"""`scaletrain launch slurm`: the sbatch script's quoting and signal logic (bash with stub srun/scontrol), then a
real single-node Slurm (slurm-wlm + munge from Debian, started by tests/slurm/start.sh) running a 2-rank CPU job,
and a preempted job that is requeued and resumes from its checkpoint."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import run_cli
from scaletrain.cli.main import main
from scaletrain.monitor import read_jsonl

SLURM_DIR = Path(__file__).parent / "slurm"
NASTY = "x\"y'z $(touch PWNED) `touch PWNED` # \\ end"
# a small fast job: 2 CPU ranks, tiny model, 300 kB of stdlib text
FAST = [
    "train.steps=20",
    "data.max_bytes=300000",
    "data.seq_len=64",
    "train.global_batch_size=16",
    "model.name=tiny",
    "monitor.progress=false",
    "monitor.log_interval=1",
    "train.eval_batches=1",
    "train.warmup_steps=2",
    "train.eval_interval=0",
]


def _launch(workdir: Path, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    return run_cli(
        ["launch", "slurm", *FAST, "--nodes", "1", "--gpus-per-node", "0", "--nproc-per-node", "2", *extra],
        cwd=workdir,
        timeout=120,
        check=check,
    )


# ---------------------------------------------------------------- the script, without Slurm

STUB_SRUN = """#!/bin/bash
# stands in for srun: records its arguments, then runs until SIGUSR1 (exit STUB_USR1_RC, default 75) or a timeout
# (exit 0); 143 is what srun reports when --kill-on-bad-exit killed a node still shutting down
printf '%s\\n' "$@" > "$STUB_DIR/srun.args"
trap 'echo usr1 > "$STUB_DIR/srun.signal"; exit ${STUB_USR1_RC:-75}' USR1
for _ in $(seq 1 ${STUB_SECONDS:-1}0); do sleep 0.1; done
exit 0
"""
STUB_SCONTROL = """#!/bin/bash
if [ "$1 $2" = "show hostnames" ]; then echo node1; echo node2; exit 0; fi
if [ "$1 $2 $3" = "show node node1" ]; then echo "NodeName=node1 Arch=x86_64 NodeAddr=10.9.8.7 NodeHostName=node1"; exit 0; fi
printf '%s ' "$@" >> "$STUB_DIR/scontrol.calls"
"""


def _stub_env(tmp_path: Path, seconds: int) -> dict:
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in (("srun", STUB_SRUN), ("scontrol", STUB_SCONTROL)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "STUB_DIR": str(tmp_path),
        "STUB_SECONDS": str(seconds),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
    }


def test_script_quotes_every_user_string_and_forwards_the_preemption_signal(tmp_path: Path) -> None:
    # a job name and an output folder made of quotes, $(...) and backticks: bash -n passes, nothing executes
    out = tmp_path / "o'ut $(touch PWNED)\"dir"
    proc = _launch(tmp_path, "--job-name", NASTY, "--partition", "gpu#1", "--out", str(out))
    script_path = out / "job.sbatch"
    script = script_path.read_text()
    assert subprocess.run(["bash", "-n", str(script_path)]).returncode == 0
    assert str(script_path) in proc.stdout
    for required in (
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@120",
        "#SBATCH --ntasks-per-node=1",
        'scontrol requeue "$SLURM_JOB_ID"',
        'scontrol show hostnames "$SLURM_JOB_NODELIST"',
    ):
        assert required in script
    assert "--gpus-per-node" not in script  # CPU ranks: no GPU request

    # the body run by bash with stub srun/scontrol: the config path reaches srun intact, as one argument
    env = _stub_env(tmp_path, seconds=30)
    # 75: every node's agent exited EXIT_REQUEUE; 143: srun's --kill-on-bad-exit killed a node that was slower to
    # exit after another exited 75 (seen with two nodes); both are a preemption once the signal was forwarded
    for usr1_rc in (75, 143):
        (tmp_path / "scontrol.calls").unlink(missing_ok=True)
        (tmp_path / "srun.args").unlink(missing_ok=True)
        batch = subprocess.Popen(
            ["bash", str(script_path)],
            cwd=tmp_path,
            env={**env, "STUB_USR1_RC": str(usr1_rc)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.time() + 20
        while not (tmp_path / "srun.args").exists() and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        batch.send_signal(signal.SIGUSR1)  # what Slurm does at --signal=B:USR1@N
        output, _ = batch.communicate(timeout=30)
        args = (tmp_path / "srun.args").read_text().splitlines()
        assert str(out / "job.toml") in args
        # the first host, named by its NodeAddr (a node name need not resolve); the port from the job id
        assert "launch.rdzv_endpoint=10.9.8.7:" + str(20000 + (4242 % 2000) * 5) in args
        assert "--mpi=none" in args and "--nproc-per-node" in args
        assert (tmp_path / "srun.signal").read_text().strip() == "usr1"  # forwarded to the step
        assert (tmp_path / "scontrol.calls").read_text().split() == ["requeue", "4242"], output
        assert f"preempted (step exit {usr1_rc}), requeueing job 4242" in output
        assert batch.returncode == 0, output
    assert not list(tmp_path.rglob("PWNED")), "a user string was executed"


def test_script_passes_through_a_failure_without_requeue(tmp_path: Path) -> None:
    _launch(tmp_path, "--out", str(tmp_path / "s"))
    env = _stub_env(tmp_path, seconds=0)
    (tmp_path / "bin" / "srun").write_text("#!/bin/bash\nexit 3\n")
    proc = subprocess.run(["bash", str(tmp_path / "s" / "job.sbatch")], env=env, capture_output=True, text=True)
    assert proc.returncode == 3
    assert not (tmp_path / "scontrol.calls").exists()
    # a node without a NodeAddr line (no such field in this scontrol's answer): the node name is the rendezvous host
    (tmp_path / "bin" / "scontrol").write_text('#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && echo node5\nexit 0\n')
    (tmp_path / "bin" / "srun").write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$STUB_DIR/srun.args"\n')
    proc = subprocess.run(["bash", str(tmp_path / "s" / "job.sbatch")], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
    assert "launch.rdzv_endpoint=node5:" + str(20000 + (4242 % 2000) * 5) in (tmp_path / "srun.args").read_text()


@pytest.mark.parametrize(
    "extra, field",
    [
        (["--nodes", "-2"], "--nodes"),
        (["--nodes", "0"], "--nodes"),
        (["--nproc-per-node", "-1"], "--nproc-per-node"),
        (["--time", "soon"], "--time"),
        (["--time", "1:00", "--signal-lead", "120"], "--time"),
        (["--job-name", "two\nlines"], "--job-name"),
        (["train.global_batch_size=15"], "train.global_batch_size"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path, extra: list[str], field: str) -> None:
    res = CliRunner().invoke(
        main,
        [
            "launch",
            "slurm",
            *FAST,
            f"run.output_dir={tmp_path / 'runs'}",
            "--gpus-per-node",
            "0",
            "--nproc-per-node",
            "2",
            *extra,
        ],
    )
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scaletrain: error: ") and field in lines[0], res.stderr
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- a real Slurm


def _sh(*cmd: str, check: bool = True, timeout: float = 30) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr}")
    return proc.stdout


@pytest.fixture(scope="module")
def slurm_cluster():
    """munged + slurmctld + slurmd on this host, started once for the module and stopped after it."""
    if os.geteuid() != 0:
        pytest.skip("a local Slurm needs root (daemons, /etc/slurm); run as root, as CI does")
    install = subprocess.run(["bash", str(SLURM_DIR / "install.sh")], capture_output=True, text=True, timeout=600)
    if install.returncode:
        pytest.skip(f"slurm-wlm + munge could not be installed: {install.stderr.strip().splitlines()[-1:]}")
    start = subprocess.run(["bash", str(SLURM_DIR / "start.sh")], capture_output=True, text=True, timeout=180)
    assert start.returncode == 0, f"tests/slurm/start.sh failed:\n{start.stderr}"
    yield
    subprocess.run(["bash", str(SLURM_DIR / "stop.sh")], capture_output=True, text=True, timeout=120)


def _job(job_id: str) -> dict[str, str]:
    text = _sh("scontrol", "show", "job", "-o", job_id, check=False)
    return dict(re.findall(r"(\w+)=(\S*)", text))


def _wait(job_id: str, done, what: str, timeout: float) -> dict[str, str]:
    deadline = time.time() + timeout
    info: dict[str, str] = {}
    while time.time() < deadline:
        info = _job(job_id)
        if done(info):
            return info
        time.sleep(0.5)
    _sh("scancel", job_id, check=False)
    raise AssertionError(f"job {job_id}: {what} not reached in {timeout:.0f} s; last state {info.get('JobState')}")


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [r["step"] for r in read_jsonl(path) if "loss" in r] if path.exists() else []


def _checkpoints(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(p.name for p in root.glob("step_*") if re.fullmatch(r"step_\d{8}", p.name)) if root.exists() else []


try:  # the trainer's preemption checkpoint (checkpoint package + SIGUSR1/SIGTERM -> exit 75)
    import scaletrain.checkpoint  # noqa: F401
    from scaletrain.train.preemption import EXIT_REQUEUE

    HAVE_PREEMPTION = EXIT_REQUEUE == 75
except ImportError:
    HAVE_PREEMPTION = False


@pytest.mark.slow  # Slurm's daemons and one 2-rank job; the sbatch script's logic stays fast above (stub srun)
@pytest.mark.skipif(
    not HAVE_PREEMPTION,
    reason="needs the trainer's preemption checkpoint (scaletrain.checkpoint, scaletrain.train.preemption)",
)
def test_real_slurm_runs_a_two_rank_job_that_is_preempted_requeued_and_resumed(slurm_cluster, tmp_path: Path) -> None:
    """One real job covers both: it runs under a hostile job name (quoted everywhere, nothing executed), is preempted
    mid-run by Slurm's advance warning, requeued, resumes from its checkpoint and completes."""
    run_dir = tmp_path / "runs" / "preempt"
    steps = 150  # ~15 s on 2 cores: long enough that the signal lands mid-run
    proc = _launch(
        tmp_path,
        "run.name=preempt",
        f"train.steps={steps}",
        "checkpoint.interval_steps=1000",
        "--job-name",
        NASTY,
        "--time",
        "30:00",
        "--signal-lead",
        "60",
        "--submit",
    )
    job_id = proc.stdout.strip().splitlines()[-1]
    assert job_id.isdigit(), proc.stdout
    assert _sh("squeue", "-h", "-j", job_id, "-o", "%j", check=False).strip() in ("", NASTY)
    deadline = time.time() + 240
    while len(_steps(run_dir)) < 5 and time.time() < deadline:
        time.sleep(0.5)
    assert _steps(run_dir), "the job never started training"
    # what Slurm does --signal-lead seconds before the time limit: SIGUSR1 to the batch shell only
    _sh("scancel", "--signal=USR1", "--batch", job_id)
    info = _wait(job_id, lambda j: j.get("Restarts", "0") != "0", "requeue", timeout=180)
    saved = _checkpoints(run_dir)
    assert saved, "no checkpoint saved on preemption"
    stopped_at = int(saved[-1].split("_")[1])
    assert 0 < stopped_at < steps
    # the rerun waits cred_expire (10 s in tests/slurm/start.sh) before it may start
    info = _wait(
        job_id,
        lambda j: j.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"),
        "completion after requeue",
        timeout=420,
    )
    log = (run_dir / f"slurm-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED", log[-4000:]
    assert "requeueing job" in log and "attempt 2" in log  # one output file, appended across attempts
    assert "resumed from" in log and f"at step {stopped_at}" in log
    logged = _steps(run_dir)
    assert logged[-1] == steps
    assert logged == sorted(set(logged))  # no step trained twice in the metrics
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == steps
    assert "training exited with code 0" in log
    assert not list(tmp_path.rglob("PWNED"))
