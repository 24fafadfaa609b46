"""In-process restart on one host (launch.restart = "in-process"), built on torch.distributed's own primitives.

The launcher starts one process per rank plus launch.spares warm spares (train/inprocess.py: imported, waiting on the
store) and orders each one through the rendezvous TCPStore. When a rank's process dies, the survivors' collective
fails, they leave the process group and wait; the launcher hands the dead rank to a spare (a fresh process when none
is left) and orders every rank into the next generation, whose process group lives under its own key prefix. The
survivors keep their processes and imports; every rank restores the newest state (checkpoint.memory_interval_steps'
host-memory snapshot when it is newer than the disk checkpoint) and the run goes on. A new spare is started for the
one taken, so the next failure finds one ready. launch.max_restarts caps the restarts, as it does for the agent.

Why not nvidia-resiliency-ext or torchft: nvidia-resiliency-ext 0.4.1 (the newest that installs beside torch 2.13 on
this Python) keeps every rank's process in its wrapper, but under the torchrun agent a SIGKILLed rank makes the agent
stop every other rank (its own launcher is needed), its abort step asks for the CUDA backend of each group, and a
restart re-runs the whole wrapped function; torchft's Manager needs its Rust lighthouse and heals replica groups
(launch.fault_tolerance = replicas' job), not ranks of one group. Tried here on CPU with gloo, December 2026.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass, field, replace

from scaletrain.config.layout import Layout
from scaletrain.config.schema import JobConfig
from scaletrain.launch.local import (
    RANK_IMPORTS,
    LocalRendezvous,
    forked_ranks,
    open_rendezvous,
    worker_environment,
)
from scaletrain.train.inprocess import (
    STOP,
    done_key,
    frozen_in_run,
    left_key,
    order_key,
    pause_key,
    paused_key,
    waiting_key,
)

POLL_S = 0.02  # how often the launcher looks at its processes and the store
HEARTBEAT_POLL_S = 0.25  # how often it reads the ranks' heartbeats for a frozen one
STOP_GRACE_S = 10.0  # how long processes told to stop get before they are killed


class RankFailed(Exception):
    """The run failed: `rank` ended with `exitcode` and no restart was left (or it asked to be requeued)."""

    def __init__(self, rank: int, exitcode: int | None):
        super().__init__(f"rank {rank} exited with {exitcode}")
        self.rank, self.exitcode = rank, exitcode


@dataclass
class _Worker:
    slot: int
    process: multiprocessing.process.BaseProcess
    orders: int = 0
    rank: int | None = None  # None: a spare, or a process waiting for its replica's rejoin
    warm_rank: int | None = None  # a spare: the rank it warms up as (train/inprocess.py warm_up)
    reserved: bool = False  # taken for a replica being refilled, not ordered yet: no longer a spare

    @property
    def pid(self) -> int:
        return self.process.pid or 0


@dataclass
class _Group:
    """Every process of the run, by slot, and which one holds each rank of the current generation."""

    cfg: JobConfig
    nproc: int
    host: str
    port: int
    store: object
    workers: list[_Worker] = field(default_factory=list)
    members: dict[int, _Worker] = field(default_factory=dict)  # rank -> process, current generation
    start_method: str = "spawn"  # forked_ranks' pick

    def start(self, spare: bool) -> _Worker:
        from scaletrain.train.inprocess import serve

        slot = len(self.workers)
        warm_rank = self.next_warm_rank() if spare else None
        forked = self.start_method == "forkserver"
        ctx = multiprocessing.get_context("forkserver") if forked else multiprocessing.get_context("spawn")
        proc = ctx.Process(
            target=serve,
            args=(slot, self.host, self.port, self.cfg.model_dump(), self.nproc, spare, warm_rank, os.getpid()),
            name=f"scaletrain-slot{slot}",
            daemon=False,
        )
        proc.start()
        if spare:  # at once: a spawned child imports the trainer's modules before serve() could lower it itself
            _lower_priority(proc.pid)
        worker = _Worker(slot, proc, warm_rank=warm_rank)
        self.workers.append(worker)
        return worker

    def order(self, worker: _Worker, generation: int, rank: int, world: int = 0) -> None:
        key = order_key(worker.slot, worker.orders)
        self.store.set(key, f"{generation} {rank} {world}")  # type: ignore[attr-defined]
        worker.orders += 1
        worker.rank = rank if rank != STOP else None
        worker.reserved = False

    def spares(self) -> list[_Worker]:
        return [w for w in self.workers if w.rank is None and w.process.is_alive() and w.orders == 0 and not w.reserved]

    def next_warm_rank(self) -> int | None:
        """The rank a new spare warms up as: the highest that no live spare warms up as (spare i of k: nproc-1-i)."""
        covered = {w.warm_rank for w in self.spares()}
        return next((r for r in reversed(range(self.nproc)) if r not in covered), None)

    def spare_for(self, rank: int) -> _Worker | None:
        """A live spare for `rank`: one that warmed up as it when there is one (it keeps all of its warm-up)."""
        spares = self.spares()
        return next((w for w in spares if w.warm_rank == rank), spares[0] if spares else None)

    def replacement(self, rank: int) -> tuple[_Worker, bool]:
        """The process that takes `rank` of the job's full numbering: a warm spare, or a new one; (it, a spare?)."""
        spare = self.spare_for(rank)
        worker = spare or self.start(spare=False)
        worker.reserved = True
        if spare is not None:  # a spare still warming up finishes at full priority (root may raise it back)
            _lower_priority(worker.pid, 0)
        return worker, spare is not None

    def waiting(self, worker: _Worker) -> bool:
        """Whether `worker` is imported and waits for its next order (ready to take a rank)."""
        return worker.process.is_alive() and self.store.check([waiting_key(worker.slot, worker.orders)])  # type: ignore[attr-defined]

    def done(self, generation: int, rank: int) -> bool:
        return self.store.check([done_key(generation, rank)])  # type: ignore[attr-defined]

    def left(self, generation: int, rank: int) -> bool:
        return self.store.check([left_key(generation, rank)])  # type: ignore[attr-defined]

    def paused(self, generation: int, rank: int) -> bool:
        return self.store.check([paused_key(generation, rank)])  # type: ignore[attr-defined]

    def frozen(self, generation: int) -> list[tuple[int, float]]:
        """The ranks of `generation` whose process froze in the training loop (frozen_ranks)."""
        pids = {r: w.pid for r, w in self.members.items() if w.process.is_alive() and not self.done(generation, r)}
        return frozen_in_run(self.cfg.run_dir(), pids, generation, self.cfg.launch.hang_timeout_s)

    def stop(self) -> None:
        """Order every live process to stop, then kill what is still there after STOP_GRACE_S."""
        for w in self.workers:
            if w.process.is_alive():
                self.order(w, 0, STOP)
        deadline = time.monotonic() + STOP_GRACE_S
        for w in self.workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            _kill_leftovers(w)


@dataclass
class _Replicas:
    """Which process holds each position of each data-parallel replica, and which replicas train now.

    Without launch.fault_tolerance=replicas the whole job is one replica: a lost rank stops everyone until its
    replacement joins (a new generation of every rank). With it, the replicas of parallel.dp_replicate train on
    without the one that lost a rank (`active`), which is refilled (`healing`) and rejoins when its processes are
    ready: the launcher asks the training ranks to pause at a step boundary, their state goes to host memory, and
    every replica starts the next generation from it."""

    full: Layout  # the job's degrees: replica r, position p is full.rank_of(r, p)
    slots: list[list[_Worker]]  # [replica][position]
    active: list[int] = field(default_factory=list)
    healing: set[int] = field(default_factory=set)
    pause_asked: int | None = None  # the generation asked to pause for a rejoin

    @classmethod
    def of(cls, cfg: JobConfig, nproc: int) -> _Replicas:
        full = Layout.from_degrees(cfg.parallel, nproc) if cfg.launch.fault_tolerance == "replicas" else None
        full = full or Layout(dp_shard=nproc)  # one replica of every rank
        return cls(full, [[] for _ in range(full.dp_replicate)], list(range(full.dp_replicate)))

    def now(self) -> Layout:
        """The current generation's numbering: the active replicas, in order, each laid out as in the job."""
        return replace(self.full, dp_replicate=len(self.active))

    def members(self) -> dict[int, _Worker]:
        now = self.now()
        return {now.rank_of(k, p): w for k, j in enumerate(self.active) for p, w in enumerate(self.slots[j])}

    def replica_of(self, rank: int) -> tuple[int, int]:
        """(replica, position) of `rank` of the current generation, replicas numbered as in the job."""
        k, position = self.now().replica_of(rank)
        return self.active[k], position


def _lower_priority(pid: int | None, niceness: int | None = None) -> None:
    """Set a process's niceness (default: a spare's); quietly kept where this process may not change it."""
    from scaletrain.train.inprocess import SPARE_NICENESS

    try:
        os.setpriority(os.PRIO_PROCESS, pid or 0, SPARE_NICENESS if niceness is None else niceness)
    except (OSError, ProcessLookupError):
        pass


def _kill_leftovers(worker: _Worker) -> None:
    """Kill what a worker that ended left in its process group: a SIGKILLed rank's checkpoint writer process lives
    on (waiting for its peers for gloo's 30 minutes) and keeps the command's output pipes open."""
    try:
        os.killpg(worker.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _say(line: str) -> None:
    # the launcher's lines go where the torchrun agent's restart lines go (monitor/rank_logs.py): the terminal
    sys.stderr.write(f"scaletrain: {line}\n")
    sys.stderr.flush()


def launch_in_process(cfg: JobConfig, nproc: int, rdzv: LocalRendezvous | None = None) -> dict:
    """Run the job on `nproc` local ranks with in-process restarts; returns rank 0's summary. RankFailed when a rank
    ends and launch.max_restarts restarts are spent (or its exit asks for a requeue)."""
    rdzv = rdzv or open_rendezvous(cfg.launch)
    assert rdzv.server is not None, "one host serves its own rendezvous store"
    worker_environment(rdzv, nproc)
    with forked_ranks(*RANK_IMPORTS, "scaletrain.train.inprocess") as start_method:
        return _supervise(cfg, nproc, rdzv, start_method)


def _supervise(cfg: JobConfig, nproc: int, rdzv: LocalRendezvous, start_method: str) -> dict:
    """launch_in_process's loop: start the ranks and spares, watch them, start generations after failures."""
    from scaletrain.exit_codes import EXIT_REQUEUE
    from scaletrain.monitor.rank_logs import failure_line

    host, port = rdzv.endpoint.rsplit(":", 1)
    group = _Group(cfg, nproc, host, int(port), rdzv.server, start_method=start_method)
    reps = _Replicas.of(cfg, nproc)
    generation, restarts = 0, 0
    watch_hangs = cfg.launch.hang_timeout_s > 0  # the heartbeats are written by the watchdog, which it switches on
    next_heartbeat_read = 0.0

    def begin() -> None:
        """Order the active replicas' processes into `generation`."""
        group.members = reps.members()
        world = len(group.members)
        for r, w in sorted(group.members.items()):
            group.order(w, generation, r, world)

    try:
        started = [group.start(spare=False) for _ in range(nproc)]
        for r, w in enumerate(started):
            replica, position = reps.full.replica_of(r)
            reps.slots[replica].append(w)  # positions come in order: replica_of is monotone in the rank
            assert reps.full.rank_of(replica, len(reps.slots[replica]) - 1) == r
        begin()
        for _ in range(cfg.launch.spares):
            group.start(spare=True)
        while True:
            time.sleep(POLL_S)
            ranks = group.members
            if all(group.done(generation, r) for r in ranks):
                return json.loads(group.store.get(done_key(generation, 0)))  # type: ignore[attr-defined]
            if watch_hangs and time.monotonic() >= next_heartbeat_read:
                next_heartbeat_read = time.monotonic() + HEARTBEAT_POLL_S
                for r, silent in group.frozen(generation):
                    w = ranks[r]
                    # a frozen rank cannot leave its collective and holds its peers in theirs until the collective
                    # timeout: SIGKILL closes its sockets, the peers' collective fails, and it is replaced as dead
                    _say(f"rank {r} (pid {w.pid}) stopped reporting {silent:.1f} s ago (frozen or wedged): killing it")
                    _kill_leftovers(w)
                    w.process.join(5.0)
            dead = {r: w for r, w in ranks.items() if not w.process.is_alive() and not group.done(generation, r)}
            if not dead:
                if ranks and all(group.left(generation, r) for r in ranks):
                    raise RankFailed(min(ranks), None)  # every rank lost a peer, none died: a collective timed out
                restarts = _refill_waiting(group, reps, restarts)
                if reps.healing and reps.pause_asked != generation and _ready(group, reps):
                    group.store.set(pause_key(generation), "")  # type: ignore[attr-defined]
                    reps.pause_asked = generation
                if reps.pause_asked == generation and all(group.paused(generation, r) for r in ranks):
                    generation += 1
                    back = sorted(reps.healing)
                    reps.active, reps.healing = list(range(reps.full.dp_replicate)), set()
                    begin()
                    _say(f"replica(s) {back} rejoin: generation {generation} trains on all {len(reps.active)}")
                continue
            rank, lost = min(dead.items())
            code = lost.process.exitcode
            if code == EXIT_REQUEUE or restarts >= cfg.launch.max_restarts:
                raise RankFailed(rank, code)
            restarts += 1
            generation += 1
            failed = {r: reps.replica_of(r) for r in dead}
            survivors = {r: w.pid for r, w in ranks.items() if r not in dead}
            for r, w in sorted(dead.items()):
                _kill_leftovers(w)
                w.rank = None
                replica, position = failed[r]
                place = reps.full.rank_of(replica, position)  # the rank it holds once every replica trains
                replacement, spare = group.replacement(place)
                reps.slots[replica][position] = replacement
                _say(
                    f"in-process restart {restarts} of {cfg.launch.max_restarts} after a failure on "
                    f"{failure_line(cfg.run_dir(), r, w.process.exitcode)}; "
                    f"{'spare' if spare else 'new process'} pid {replacement.pid} takes rank {place}, "
                    f"ranks {sorted(survivors)} keep pids {[survivors[s] for s in sorted(survivors)]}"
                )
            lost_replicas = {replica for replica, _ in failed.values()}
            if cfg.launch.fault_tolerance == "replicas" and len(reps.active) > len(lost_replicas):
                reps.active = [j for j in reps.active if j not in lost_replicas]
                reps.healing |= lost_replicas
                _say(
                    f"replica(s) {sorted(lost_replicas)} lost a rank: {len(reps.active)} of "
                    f"{reps.full.dp_replicate} replicas train on in generation {generation} (the same global batch) "
                    f"while it is refilled"
                )
            else:
                reps.active, reps.healing = list(range(reps.full.dp_replicate)), set()
            begin()
            while len(group.spares()) < cfg.launch.spares:  # ready for the next failure
                group.start(spare=True)
    finally:
        group.stop()
        rdzv.server = None


def _refill_waiting(group: _Group, reps: _Replicas, restarts: int) -> int:
    """Replace a process of a replica being refilled that died while it waited; returns the restarts counted."""
    from scaletrain.exit_codes import EXIT_REQUEUE

    for replica in sorted(reps.healing):
        for position, w in enumerate(reps.slots[replica]):
            if w.process.is_alive():
                continue
            rank = reps.full.rank_of(replica, position)
            if w.process.exitcode == EXIT_REQUEUE or restarts >= group.cfg.launch.max_restarts:
                raise RankFailed(rank, w.process.exitcode)
            _kill_leftovers(w)
            reps.slots[replica][position], _ = group.replacement(rank)
            restarts += 1
    return restarts


def _ready(group: _Group, reps: _Replicas) -> bool:
    """Whether every process of the replicas being refilled waits for its order (imported, its old group left)."""
    return all(group.waiting(w) for replica in reps.healing for w in reps.slots[replica])
