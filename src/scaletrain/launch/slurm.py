"""Slurm: render an sbatch script that runs one `scaletrain train` agent per node, and submit it.

The script is plain bash a reader can audit. Each node's agent (the torchrun agent inside `scaletrain train`)
meets the others at a c10d rendezvous on the first host of the allocation. Preemption and time limits:
`--signal=B:USR1@N` reaches the batch shell N seconds before the end; it forwards the signal to the `srun` step,
which forwards it to every agent; the trainer checkpoints and exits EXIT_REQUEUE (75); the shell then calls
`scontrol requeue`, and the rerun resumes from the newest checkpoint under the run folder. The output file is
opened in append mode so the rerun adds to it. The rendezvous host is named by its Slurm NodeAddr, the address
slurmctld itself reaches it by, so node names need not resolve on the nodes.

Quoting: every user string in the shell body goes through shlex.quote. `#SBATCH` lines are not read by the shell
but by sbatch's own parser, which knows double quotes and backslash escapes (not single quotes) and treats an
unescaped `#` as the start of a comment; they get sbatch_quote.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from scaletrain.exit_codes import EXIT_REQUEUE
from scaletrain.launch.counts import check_rank_counts

# Rendezvous ports: unprivileged and below Linux's default ephemeral range (32768-60999), so an outgoing
# connection never holds it. Every node computes the same port from the job id; the restart count moves it,
# so a requeued run never meets a socket of its previous attempt in TIME_WAIT.
PORT_BASE, PORT_SLOTS, PORTS_PER_JOB = 20000, 2000, 5

# Slurm time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


@dataclass
class SlurmOptions:
    """What `scaletrain launch slurm` puts in the sbatch header and the srun line."""

    nodes: int = 1
    gpus_per_node: int = 0
    nproc_per_node: int = 0  # ranks per node; 0: gpus_per_node, or 2 CPU ranks when it is 0 too
    job_name: str = ""
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None
    constraint: str | None = None
    cpus_per_node: int | None = None
    mem: str | None = None
    signal_lead_s: int = 120  # Slurm may deliver it up to 60 s earlier than asked
    port: int | None = None  # fixed rendezvous port instead of the job-id-derived one
    extra_sbatch: list[str] = field(default_factory=list)  # raw `--key=value` options, sbatch-quoted

    def ranks_per_node(self) -> int:
        return self.nproc_per_node or self.gpus_per_node or 2


def time_limit_seconds(text: str) -> int | None:
    """Seconds in a Slurm time limit string; None for UNLIMITED/INFINITE. ValueError on anything else."""
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return None
    m = _TIME.match(text)
    if not m:
        raise ValueError(f"--time: {text!r} is not a Slurm time (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS)")
    d, a, b, c = (int(x) if x else None for x in m.groups())
    assert a is not None  # the pattern always captures the first number
    if d is not None:  # D-H[:M[:S]]
        return d * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    if c is not None:
        return a * 3600 + (b or 0) * 60 + c
    if b is not None:
        return a * 60 + b
    return a * 60


def check_options(opts: SlurmOptions) -> None:
    """Refuse bad input before anything is written: ValueError with one line naming the option."""
    check_rank_counts(opts.nodes, opts.gpus_per_node, opts.nproc_per_node, "node")
    if opts.cpus_per_node is not None and opts.cpus_per_node < 1:
        raise ValueError(f"--cpus-per-node: must be at least 1 (got {opts.cpus_per_node})")
    if opts.signal_lead_s < 1:
        raise ValueError(f"--signal-lead: must be at least 1 second (got {opts.signal_lead_s})")
    if opts.port is not None and not 1024 <= opts.port <= 65535:
        raise ValueError(f"--port: {opts.port} is not an unprivileged port (1024-65535)")
    if opts.time:
        limit = time_limit_seconds(opts.time)
        if limit is not None and limit <= opts.signal_lead_s:
            raise ValueError(
                f"--time: {opts.time} leaves no training before the preemption signal "
                f"{opts.signal_lead_s} s ahead of the end; raise --time or lower --signal-lead"
            )
    for name in ("job_name", "partition", "account", "qos", "time", "constraint", "mem"):
        value = getattr(opts, name)
        if value is not None and ("\n" in value or "\r" in value or "\0" in value):
            raise ValueError(f"--{name.replace('_', '-')}: must be one line")
    for raw in opts.extra_sbatch:
        if not raw.startswith("--") or "\n" in raw or "\0" in raw:
            raise ValueError(f"--sbatch: {raw!r} must be one long option like --mail-type=END")


def sbatch_quote(value: str) -> str:
    """Quote a value for an `#SBATCH` line: sbatch's parser reads double quotes and backslash escapes, and an
    unescaped `#` starts a comment even inside quotes."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("#", "\\#")
    return f'"{escaped}"'


def _header(opts: SlurmOptions, output: Path, workdir: Path) -> list[str]:
    lines = [
        f"--job-name={sbatch_quote(opts.job_name)}",
        f"--nodes={opts.nodes}",
        "--ntasks-per-node=1",  # one agent per node; the agent starts the node's ranks
    ]
    if opts.gpus_per_node:
        lines.append(f"--gpus-per-node={opts.gpus_per_node}")
    if opts.cpus_per_node:
        lines.append(f"--cpus-per-task={opts.cpus_per_node}")
    for name, flag in (
        ("partition", "partition"),
        ("account", "account"),
        ("qos", "qos"),
        ("time", "time"),
        ("constraint", "constraint"),
        ("mem", "mem"),
    ):
        value = getattr(opts, name)
        if value:
            lines.append(f"--{flag}={sbatch_quote(value)}")
    lines += [
        f"--output={sbatch_quote(str(output))}",
        "--open-mode=append",  # a requeued run appends to the same log instead of truncating it
        "--requeue",
        f"--signal=B:USR1@{opts.signal_lead_s}",  # B: the batch shell gets it, and forwards it below
        f"--chdir={sbatch_quote(str(workdir))}",
    ]
    for raw in opts.extra_sbatch:
        key, eq, value = raw.partition("=")
        lines.append(f"{key}={sbatch_quote(value)}" if eq else key)
    return [f"#SBATCH {line}" for line in lines]


def render_sbatch(
    config_path: Path, opts: SlurmOptions, workdir: Path, output: Path, python: str = sys.executable
) -> str:
    """The sbatch script (text) that trains the resolved config at config_path on opts.nodes nodes."""
    q = shlex.quote
    port_expr = (
        str(opts.port)
        if opts.port
        else f"$(( {PORT_BASE} + (SLURM_JOB_ID % {PORT_SLOTS}) * {PORTS_PER_JOB} "
        f"+ ${{SLURM_RESTART_COUNT:-0}} % {PORTS_PER_JOB} ))"
    )
    body = f"""\
set -uo pipefail

EXIT_REQUEUE={EXIT_REQUEUE}   # the trainer saved a checkpoint on a signal and asks to be run again
PYTHON={q(python)}
CONFIG={q(str(config_path))}
NPROC_PER_NODE={opts.ranks_per_node()}

# c10d rendezvous on the allocation's first host, at the address Slurm itself reaches it by (its NodeAddr;
# Slurm defaults that to the node name): a node name need not resolve on the nodes
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
HEAD_ADDR=$(scontrol show node "$HEAD" -o 2>/dev/null | sed -n 's/.* NodeAddr=\\([^ ]*\\).*/\\1/p')
HEAD_ADDR=${{HEAD_ADDR:-$HEAD}}
case "$HEAD_ADDR" in *:*) HEAD_ADDR="[$HEAD_ADDR]" ;; esac   # an IPv6 address: [addr]:port
PORT={port_expr}
echo "scaletrain: job $SLURM_JOB_ID attempt $(( ${{SLURM_RESTART_COUNT:-0}} + 1 ))" \
  "on $SLURM_JOB_NUM_NODES node(s), rendezvous $HEAD_ADDR:$PORT ($HEAD)"

# a signal before the step starts is remembered and forwarded once it runs
STEP_PID=
PENDING_SIGNAL=
FORWARDED=
forward_signal() {{
  echo "scaletrain: $1 received, asking the ranks to checkpoint and stop"
  if [ -n "$STEP_PID" ]; then
    kill -s "$1" "$STEP_PID" 2>/dev/null || true   # srun forwards it to every node's agent
    FORWARDED=$1
  else
    PENDING_SIGNAL=$1
  fi
}}
trap 'forward_signal USR1' USR1

# srun in the background and `wait`: bash runs a trap only between commands, and `wait` is interruptible
# --mpi=none: a site default of pmix/pmi2 would export MPI rank variables, and the agent would take them for
# an MPI launch of single ranks
srun --mpi=none --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \\
  ${{SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"}} \\
  "$PYTHON" -m scaletrain.cli.main train "$CONFIG" --nproc-per-node "$NPROC_PER_NODE" \\
  launch.nnodes="$SLURM_JOB_NUM_NODES" launch.rdzv_endpoint="$HEAD_ADDR:$PORT" &
STEP_PID=$!
[ -z "$PENDING_SIGNAL" ] || forward_signal "$PENDING_SIGNAL"

while :; do
  wait "$STEP_PID"; rc=$?
  kill -0 "$STEP_PID" 2>/dev/null || break   # wait returned for a trapped signal: the step still runs
done

# After a forwarded signal, any failure code is a preemption too: with several nodes, --kill-on-bad-exit ends the
# step as soon as the first agent exits $EXIT_REQUEUE and kills a node still shutting down (srun then reports 143).
# The ranks of every node saved the checkpoint together before any exited; the rerun resumes from the newest one.
if [ "$rc" -eq "$EXIT_REQUEUE" ] || {{ [ -n "$FORWARDED" ] && [ "$rc" -ne 0 ]; }}; then
  echo "scaletrain: preempted (step exit $rc), requeueing job $SLURM_JOB_ID; the rerun resumes from the newest checkpoint"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
echo "scaletrain: training exited with code $rc"
exit "$rc"
"""
    head = [
        "#!/bin/bash",
        "# Generated by `scaletrain launch slurm`. Submit with: sbatch THIS_FILE",
        *_header(opts, output, workdir),
    ]
    return "\n".join(head) + "\n\n" + body


def bash_syntax_ok(script: str) -> tuple[bool, str]:
    """(ok, message) of `bash -n` over the script text."""
    proc = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    return proc.returncode == 0, proc.stderr.strip()


def submit(script_path: Path) -> str:
    """Submit with `sbatch --parsable`; returns the job id. RuntimeError with sbatch's message on failure."""
    if shutil.which("sbatch") is None:
        raise RuntimeError("sbatch not found on PATH; run this on a Slurm login node, or drop --submit")
    proc = subprocess.run(["sbatch", "--parsable", str(script_path)], capture_output=True, text=True)
    if proc.returncode != 0:
        msg = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise RuntimeError(f"sbatch failed: {msg[-1] if msg else f'exit {proc.returncode}'}")
    return proc.stdout.strip().split(";")[0]  # "jobid[;cluster]"
