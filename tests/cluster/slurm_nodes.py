"""A Slurm of simulated nodes: munged and slurmctld in node 0, one slurmd in every node (Debian's slurm-wlm).

Each daemon runs inside its node's network namespace (`nsenter --net`, which leaves the mounts alone: `ip netns
exec` remounts /sys, where slurmd needs the host's cgroup mounts) and in a UTS namespace of its own whose host name
is the Slurm node name, so slurmctld finds itself in SlurmctldHost and each slurmd finds its NodeName without `-N`
(two slurmd on one machine need no --enable-multiple-slurmd this way). Job steps inherit both from their slurmd.
Every node's slurmd reaches slurmctld at 198.51.100.1; clients (sbatch, scontrol) run in node 0, the login node.

Nothing collides with the single-node Slurm of tests/slurm/start.sh: the configuration (SLURM_CONF), state, spool,
logs, pid files and munged's key and socket all live in one temporary folder `stc<pid>-slurm-*`, and the ports
are in the nodes' own namespaces. munged is a daemon of its own with its own socket (a filesystem path, which every
namespace reaches); Slurm is pointed at it with AuthInfo=socket=. Every daemon is a process of node 0 or node 1, so
`Cluster.close()` ends them all with the nodes; `close()` first cancels the jobs and stops the daemons in order.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from cluster_nodes import _NAME, PREFIX, Cluster, _alive

INSTALL = Path(__file__).resolve().parent.parent / "slurm" / "install.sh"
CTLD_PORT, SLURMD_PORT = 6917, 6918  # not the single-node test's 6817/6818 (they live in other namespaces anyway)


def unavailable() -> str | None:
    """Why a Slurm of simulated nodes cannot run here (after trying tests/slurm/install.sh), or None."""
    for tool in ("nsenter", "unshare", "runuser"):
        if shutil.which(tool) is None:
            return f"a Slurm of simulated nodes needs util-linux's `{tool}`"
    proc = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, timeout=600)
    if proc.returncode:
        return f"slurm-wlm + munge could not be installed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


def clean_leftovers() -> None:
    """Delete the folders of Slurms whose test process is dead (their daemons died with their namespaces)."""
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-slurm-*"):
        m = _NAME.match(path.name)
        if m and not _alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)


def _node_hardware() -> str:
    """This machine's CPUs/memory line from `slurmd -C`, without the node name (every simulated node has it)."""
    line = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30, check=True).stdout
    first = line.splitlines()[0] if line else ""
    if not first.startswith("NodeName="):
        raise RuntimeError(f"slurmd -C gave: {line!r}")
    return " ".join(first.split()[1:])


@dataclass
class SlurmNodes:
    cluster: Cluster
    base: Path
    names: list[str]  # Slurm node name (and host name) of each node
    pidfiles: list[tuple[Path, str]] = field(default_factory=list)  # (pid file, /proc comm), in start order

    @property
    def conf(self) -> Path:
        return self.base / "slurm.conf"

    def env(self) -> dict[str, str]:
        """The environment of a client: SLURM_CONF points at this cluster's configuration (sbatch hands it on to
        the job, so the batch script's scontrol and srun find it too)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def command(self, node: int, args: list[str]) -> list[str]:
        """`args` run in node `node`'s network namespace with its host name."""
        ns = f"/run/netns/{self.cluster.nodes[node].ns}"
        in_node = ["nsenter", f"--net={ns}", "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"']
        return [*in_node, self.names[node], *args]

    def run(self, args: list[str], node: int = 0, check: bool = True, timeout: float = 60, **kw):
        """Run a client command (sbatch, scontrol, `scaletrain launch slurm --submit`) in node `node`."""
        proc = subprocess.run(
            self.command(node, args), env=self.env(), capture_output=True, text=True, timeout=timeout, **kw
        )
        if check and proc.returncode:
            raise AssertionError(f"{' '.join(args)} exited {proc.returncode}: {proc.stderr[-2000:]}")
        return proc

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (empty while the controller does not answer)."""
        out = self.run(["scontrol", "show", "job", "-o", job_id], check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    @classmethod
    def start(cls, cluster: Cluster, wait_s: float = 60) -> SlurmNodes:
        """munged + slurmctld in node 0 and a slurmd in every node; returns once every node is idle.
        RuntimeError with the daemons' log tails when they are not up within wait_s seconds."""
        clean_leftovers()
        base = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-slurm-"))
        base.chmod(0o755)  # munged checks that every folder above its socket lets everyone through
        slurm = cls(cluster, base, [f"node{n.index}" for n in cluster.nodes])
        try:
            slurm._start_munge()
            slurm._write_conf()
            slurm._daemon(0, ["slurmctld", "-c"], base / "ctld" / "slurmctld.pid", "slurmctld")
            for i, name in enumerate(slurm.names):
                slurm._daemon(i, ["slurmd"], base / name / "slurmd.pid", "slurmd")
            slurm._wait_idle(wait_s)
        except BaseException:
            slurm.close()
            raise
        return slurm

    def _start_munge(self) -> None:
        key, sock = self.base / "munge", self.base / "msock"
        for path, mode in ((key, 0o700), (sock, 0o755)):  # key folder private; the socket's open to all
            path.mkdir()
            shutil.chown(path, "munge", "munge")
            path.chmod(mode)
        as_munge = ["runuser", "-u", "munge", "--"]
        subprocess.run(
            [*as_munge, "mungekey", "--create", f"--keyfile={key}/munge.key"],
            check=True,
            timeout=30,
            capture_output=True,
        )
        munged = [*as_munge, "munged", f"--key-file={key}/munge.key", f"--socket={sock}/socket"]
        munged += [f"--pid-file={sock}/munged.pid", f"--log-file={key}/munged.log", f"--seed-file={key}/seed"]
        self._daemon(0, munged, sock / "munged.pid", "munged")

    def _write_conf(self) -> None:
        b, hw = self.base, _node_hardware()
        (b / "ctld").mkdir()
        for name in self.names:
            (b / name / "spool").mkdir(parents=True)
        nodes = [
            f"NodeName={name} NodeAddr={n.addr} {hw} State=UNKNOWN" for name, n in zip(self.names, self.cluster.nodes)
        ]
        self.conf.write_text(
            f"""# generated by scaletrain tests/cluster/slurm_nodes.py
ClusterName=stc{os.getpid()}
SlurmctldHost={self.names[0]}({self.cluster.nodes[0].addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# our own munged; cred_expire is also how long a requeued job waits before it may start again (default 120 s)
AuthInfo=socket={b}/msock/socket,cred_expire=5
MpiDefault=none
# no cgroup plugins: PID 1 is not systemd on CI machines
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
ReturnToService=2
KillWait=5
MailProg=/bin/true
StateSaveLocation={b}/ctld
SlurmctldPidFile={b}/ctld/slurmctld.pid
SlurmctldLogFile={b}/ctld/slurmctld.log
# %n: the node name, so each node's slurmd has its own folder
SlurmdSpoolDir={b}/%n/spool
SlurmdPidFile={b}/%n/slurmd.pid
SlurmdLogFile={b}/%n/slurmd.log
SlurmctldPort={CTLD_PORT}
SlurmdPort={SLURMD_PORT}
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
{chr(10).join(nodes)}
PartitionName=debug Nodes={",".join(self.names)} Default=YES MaxTime=INFINITE State=UP
"""
        )

    def _daemon(self, node: int, args: list[str], pidfile: Path, comm: str) -> None:
        """Start a daemon (it forks and writes its pid file) in node `node`; wait for its pid file."""
        proc = subprocess.run(self.command(node, args), env=self.env(), capture_output=True, text=True, timeout=60)
        if proc.returncode:
            raise RuntimeError(f"{comm} did not start in {self.names[node]}: {proc.stderr.strip()}\n{self.logs()}")
        self.pidfiles.append((pidfile, comm))
        deadline = time.monotonic() + 20
        while self._pid(pidfile, comm) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{comm} in {self.names[node]} wrote no pid file {pidfile}\n{self.logs()}")
            time.sleep(0.05)

    @staticmethod
    def _pid(pidfile: Path, comm: str) -> int | None:
        """The pid in `pidfile` if that process runs and is `comm` (never a reused pid)."""
        try:
            pid = int(pidfile.read_text().strip())
            return pid if Path(f"/proc/{pid}/comm").read_text().strip() == comm else None
        except (OSError, ValueError):
            return None

    def _wait_idle(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        states = ""
        while time.monotonic() < deadline:
            states = self.run(["sinfo", "-h", "-N", "-o", "%N=%T"], check=False).stdout.split()
            if sorted(states) == sorted(f"{name}=idle" for name in self.names):
                return
            time.sleep(0.2)
        raise RuntimeError(f"slurm nodes not idle after {wait_s:.0f} s: {states}\n{self.logs()}")

    def logs(self, lines: int = 15) -> str:
        """The tails of every daemon's log (for a failure message)."""
        out = []
        for path in sorted(self.base.glob("*/*.log")):
            text = [ln for ln in path.read_text(errors="replace").splitlines() if "pmix" not in ln.lower()]
            out.append(f"--- {path.relative_to(self.base)}\n" + "\n".join(text[-lines:]))
        return "\n".join(out)

    def close(self) -> None:
        """Cancel every job (job processes outlive slurmd), stop the daemons by pid file (newest first), delete the
        folder. Safe to call twice; whatever is left dies with the nodes in Cluster.close()."""
        if self._pid(self.base / "ctld" / "slurmctld.pid", "slurmctld"):
            jobs = self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()
            if jobs:
                self.run(["scancel", *jobs], check=False)
                deadline = time.monotonic() + 30
                while self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split():
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.3)
        for pidfile, comm in reversed(self.pidfiles):
            pid = self._pid(pidfile, comm)
            if pid is None:
                continue
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while _alive(pid) and self._pid(pidfile, comm) == pid and time.monotonic() < deadline:
                time.sleep(0.05)
            if self._pid(pidfile, comm) == pid:
                os.kill(pid, signal.SIGKILL)
        self.pidfiles.clear()
        shutil.rmtree(self.base, ignore_errors=True)


def make_slurm(cluster: Cluster):
    """Generator for a pytest fixture: skips with the reason when Slurm cannot run here, yields the started
    SlurmNodes and always stops it (also after a failed test)."""
    import pytest

    why = unavailable()
    if why:
        pytest.skip(why)
    slurm = SlurmNodes.start(cluster)
    try:
        yield slurm
    finally:
        slurm.close()
