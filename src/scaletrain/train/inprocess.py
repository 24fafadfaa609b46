"""One worker process of an in-process restart job (launch.restart = "in-process"; started by launch/inprocess.py).

The process outlives its process group. It imports torch and scaletrain once, then runs the generations the launcher
orders through its TCPStore: generation g joins a process group whose keys live under their own prefix, builds the
trainer, resumes from the newest state (a memory snapshot when it is newer than the disk checkpoint) and trains. When
a peer dies, the collective in flight fails (gloo: the dead rank's sockets close); the rank leaves the group, keeps its
process and imports, and waits for generation g+1 with the same rank. A warm spare is such a process started before
any failure: imported and waiting for its first order, it takes the dead rank's place without paying the imports.

A spare also warms up while it waits (CPU runs): it builds the job's trainer on a fake process group of the job's
world size (torch's own, torch.testing._internal.distributed.fake_pg, as the layout trace uses it), as the rank the
launcher expects it to take, and takes one step. What a process pays the first time it runs the job's code is then
paid before any failure: DTensor's sharding propagation for each operator, the first optimizer step that a restore's
state-dict load runs, the kernels' first calls, the lazy imports. Without it the survivors, warm since generation 0,
would wait in every collective of the restore and the first step for the cold replacement. DTensor caches those
results by mesh, and a DeviceMesh compares by ranks, shape and names only: the fake mesh's entries serve the real
mesh, as a survivor's entries of one generation serve the next (the groups are found again by name), but they carry
the rank's coordinate. So a spare that takes another rank than it warmed as empties the caches that hold a mesh
first (it would otherwise place its shards at the other rank's offsets), and keeps only the rest of the warm-up.
The torch RNG state is put back after it.

Module level imports stay light: the launcher lowers a spare's priority as it starts it, before it imports torch,
so that on a host short of cores its imports do not slow the ranks that train.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

PREFIX = "scaletrain-inprocess"
STOP = -1  # the rank of an order that ends the process
SPARE_NICENESS = 10  # a spare's CPU priority while it imports and waits (restored when it takes a rank)
CONNECT_S = 30.0  # TCPStore's connect, once the launcher's store was seen listening


def order_key(slot: int, number: int) -> str:
    """The launcher's `number`-th order to the process of `slot`: "GENERATION RANK WORLD" (rank -1: stop)."""
    return f"{PREFIX}/slot{slot}/order{number}"


def waiting_key(slot: int, number: int) -> str:
    """Set by the process of `slot` once it waits for its `number`-th order (imported: ready to take a rank)."""
    return f"{PREFIX}/slot{slot}/waiting{number}"


def pause_key(generation: int) -> str:
    """Set by the launcher: `generation`'s ranks stop at the next step boundary they agree on, their state in a
    host-memory snapshot (a refilled replica rejoins in the next generation: launch.fault_tolerance=replicas)."""
    return f"{PREFIX}/gen{generation}/pause"


def paused_key(generation: int, rank: int) -> str:
    """Set by `rank` when it paused in `generation` (pause_key) and waits for the next one."""
    return f"{PREFIX}/gen{generation}/paused{rank}"


def done_key(generation: int, rank: int) -> str:
    """Set by `rank` when it finished training in `generation`; rank 0's value is the run summary (JSON)."""
    return f"{PREFIX}/gen{generation}/done{rank}"


def left_key(generation: int, rank: int) -> str:
    """Set by `rank` when it left `generation` after losing a peer, waiting for the next one."""
    return f"{PREFIX}/gen{generation}/left{rank}"


def group_prefix(generation: int) -> str:
    """The prefix of `generation`'s process-group keys: a new group never reads an older one's addresses."""
    return f"{PREFIX}/gen{generation}/group"


@dataclass(frozen=True)
class Order:
    generation: int
    rank: int  # STOP: leave
    world: int = 0  # the generation's world size: fewer than the job's ranks while a replica is refilled


def peer_lost(exc: BaseException) -> bool:
    """Whether `exc` is a collective failing because a peer went away (this rank can go on in a new group), as
    opposed to this rank's own error (which ends its process, as under the torchrun agent)."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):  # DistBackendError, DistNetworkError, DistStoreError
        return True
    text = str(exc)
    # gloo's messages when the peer's sockets closed under a collective (torch 2.13, gloo's tcp/pair.cc)
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "[gloo")
    )


def frozen_ranks(
    beats: list[dict], pids: dict[int, int], generation: int, now: float, limit_s: float
) -> list[tuple[int, float]]:
    """(rank, silent seconds) of each rank in `pids` (rank -> pid of its live process) whose heartbeat of
    `generation` was not rewritten for over `limit_s` while it was in the training loop: SIGSTOP, a wedged call.
    train/watchdog.py's thread rewrites the record about every second even while the training thread waits in a
    collective, so only a frozen process falls silent; a rank outside the loop (building, saving, done) or a record
    of an earlier generation or process is not judged."""
    found = []
    for beat in beats:
        rank = beat.get("rank", -1)
        if rank not in pids or beat.get("pid") != pids[rank] or beat.get("round") != generation:
            continue
        if beat.get("watching", False) and now - beat["time"] > limit_s:
            found.append((rank, now - beat["time"]))
    return sorted(found)


def frozen_in_run(run_dir, pids: dict[int, int], generation: int, hang_timeout_s: float) -> list[tuple[int, float]]:
    """frozen_ranks over the heartbeats of the run in `run_dir`, silent for train/watchdog.py's silence limit."""
    from scaletrain.train.watchdog import read_heartbeats, silent_after

    beats = read_heartbeats(run_dir / "heartbeat")
    return frozen_ranks(beats, pids, generation, time.time(), silent_after(hang_timeout_s))


class _Process:
    """This worker's side of the launcher's store: its orders, and its reports."""

    def __init__(self, slot: int, host: str, port: int, timeout_s: float, launcher: int):
        import datetime

        import torch.distributed as dist

        self.slot, self.orders = slot, 0
        self.launcher = launcher  # its pid, given: the parent looked up after the imports may already be init
        # look that the store's server listens, between looks that the launcher still runs, before TCPStore
        # connects: its constructor retries in C++ for the whole timeout whatever it is given, holding the GIL, so
        # a launcher killed before this process connected would leave it there for the collective timeout
        deadline = time.monotonic() + timeout_s
        while not _listening(host, port):
            if self.launcher_gone() or time.monotonic() > deadline:
                raise SystemExit(1)
            time.sleep(0.1)
        try:
            store = dist.TCPStore(
                host, port, is_master=False, timeout=datetime.timedelta(seconds=CONNECT_S), wait_for_workers=False
            )
        except Exception:  # noqa: BLE001  DistNetworkError / DistStoreError: the launcher went in between
            raise SystemExit(1) from None
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        self.store = store

    def launcher_gone(self) -> bool:
        """Whether the launcher that started this process has ended (this process was handed to another parent)."""
        return os.getppid() != self.launcher

    def next_order(self) -> Order:
        """Block until the launcher gives this process its next order."""
        import datetime

        key = order_key(self.slot, self.orders)
        self.store.set(waiting_key(self.slot, self.orders), "")
        self.orders += 1
        # a spare waits as long as the run lasts: wait in slices so a long quiet run never trips the store timeout
        while True:
            try:
                self.store.wait([key], datetime.timedelta(seconds=60))
                break
            except Exception as e:  # noqa: BLE001  the store's timeout (DistStoreError); anything else is real
                if self.launcher_gone():
                    raise SystemExit(1) from None  # its store went with it: nothing to wait for
                if "timeout" not in str(e).lower() and "Timeout" not in type(e).__name__:
                    raise
        generation, rank, world = (int(x) for x in self.store.get(key).decode().split())
        return Order(generation, rank, world)


def _listening(host: str, port: int) -> bool:
    """Whether a TCP server accepts at host:port (a bare connect and close: the store's server drops it)."""
    import socket

    try:
        socket.create_connection((host, port), timeout=1.0).close()
    except OSError:
        return False
    return True


def serve(
    slot: int, host: str, port: int, tree: dict, nproc: int, spare: bool, warm_rank: int | None, launcher: int
) -> None:
    """Process entry (spawned by the launcher): import everything once, then run the generations the launcher orders
    until it says stop. A rank's own error ends the process (exit 1) after logging it to the rank log."""
    # its own process group: when it dies, the launcher kills what it leaves behind (its checkpoint writer)
    os.setpgid(0, 0)
    # a spare runs at the lower priority the launcher gave it as it started it (not set here again: the launcher
    # may have raised it back already, having given the spare a place while it was still importing)
    from scaletrain.config import validate_config
    from scaletrain.train import loop  # noqa: F401  the trainer's imports (torch, the models, DCP), paid here once

    cfg = validate_config(tree)
    process = _Process(slot, host, port, cfg.launch.collective_timeout_s, launcher)
    warmed = spare and warm_rank is not None and warm_up(cfg, nproc, warm_rank) == ""
    terminal = os.dup(2)  # the launcher's stderr: each generation's rank log redirect starts from it
    while True:
        order = process.next_order()
        if order.rank == STOP:
            return
        if spare:
            _set_niceness(0)
            spare = False
            if warmed and order.rank != warm_rank:
                forget_mesh_caches()
        _run_generation(cfg, process, order, nproc, terminal)


def warm_up(cfg, nproc: int, rank: int) -> str:
    """Build the job's trainer on a fake process group of `nproc` ranks as `rank` and take one step, then drop it all
    but the caches (see the module docstring; forget_mesh_caches() before serving as another rank). CPU jobs only (on
    a GPU it would take memory on a device the ranks use). Returns "" when it ran, else why not: a failure only
    leaves a colder spare, never ends it. Output goes nowhere: the spare shares the launcher's terminal."""
    import contextlib
    import io
    import logging

    import torch
    import torch.distributed as dist

    from scaletrain.parallel.runtime import init_distributed, pick_device_type
    from scaletrain.resolve import settle_device_defaults
    from scaletrain.train.trainer import Trainer

    device_type = pick_device_type(cfg.run.device)
    if device_type != "cpu":
        return f"a {device_type} job (spares warm up on CPU jobs only)"
    if dist.is_initialized():
        return "a process group is up"
    if _mesh_caches() is None:  # a spare may take another rank: warm up only where that can be undone
        return f"torch {torch.__version__} lacks a DTensor cache a spare must be able to empty"
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rng = torch.get_rng_state()
    trainer, failed = None, ""
    quiet = io.StringIO()
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(quiet), contextlib.redirect_stdout(quiet):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=nproc)
            cfg = settle_device_defaults(cfg, device_type)
            trainer = Trainer.build(cfg, init_distributed(device_type, cfg.launch.collective_timeout_s))
            trainer.train_step(1)
    except Exception as e:  # noqa: BLE001  a warm-up that fails leaves a cold spare, which still works
        failed = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    finally:
        _close(trainer)
        if dist.is_initialized():
            dist.destroy_process_group()
        logging.disable(logging.NOTSET)
        torch.set_rng_state(rng)
    if failed:
        forget_mesh_caches()
    return failed


def forget_mesh_caches() -> None:
    """Empty every process-wide DTensor cache whose results hold a DeviceMesh (_mesh_caches)."""
    for clear in _mesh_caches() or []:
        clear()


def _mesh_caches():
    """The clear() of each process-wide DTensor cache whose results hold a DeviceMesh (torch 2.13: the native and the
    Python sharding-propagation caches, the redistribution plans, the mesh topology), or None when this torch lacks
    one of them. The tensor-metadata cache stays: its values are shapes and strides, the same on every rank."""
    import torch
    from torch.distributed.tensor import DTensor

    try:
        from torch.distributed.tensor._collective_utils import MeshTopoInfo
        from torch.distributed.tensor._redistribute import _gen_transform_infos

        return [
            torch._C._clear_DTensor_sharding_propagator_cache,
            DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear,
            _gen_transform_infos.cache_clear,
            MeshTopoInfo.build_from_mesh.cache_clear,
        ]
    except (ImportError, AttributeError):
        return None


def _set_niceness(level: int) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, 0, level)
    except OSError:  # lowering it back needs CAP_SYS_NICE: then the spare keeps training at the lower priority
        pass


def _run_generation(cfg, process: _Process, order: Order, nproc: int, terminal: int) -> None:
    """Train as `order.rank` in `order.generation` until the run ends (done key) or a peer is lost (left key)."""
    import datetime

    import torch.distributed as dist

    from scaletrain.monitor import configure_logging
    from scaletrain.monitor.rank_logs import log_exception, redirect_to_rank_log
    from scaletrain.parallel.runtime import init_distributed, pick_device_type, shutdown_distributed
    from scaletrain.resolve import settle_device_defaults
    from scaletrain.train.loop import Paused, fit
    from scaletrain.train.trainer import Trainer

    generation, rank, world = order.generation, order.rank, order.world or nproc
    if world != nproc:  # launch.fault_tolerance=replicas: the replicas left train on, each the same ranks
        cfg = cfg.with_replicas(cfg.parallel.dp_replicate * world // nproc)
    # what the rank's code reads of the launcher's environment (the torchrun agent sets the same)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        GROUP_RANK="0",
        TORCHELASTIC_RESTART_COUNT=str(generation),  # the rank log's "attempt"
    )
    os.dup2(terminal, 2)
    console = redirect_to_rank_log(cfg.run_dir(), rank)
    sys.stderr.write(f"in-process restart: generation {generation}, rank {rank}, pid {os.getpid()}\n")
    device_type = pick_device_type(cfg.run.device)
    cfg = settle_device_defaults(cfg, device_type)
    trainer = None
    t0 = time.perf_counter()
    try:
        dist.init_process_group(
            "nccl" if device_type == "cuda" else "gloo",
            store=dist.PrefixStore(group_prefix(generation), process.store),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=cfg.launch.collective_timeout_s),
        )
        # the group above gives the device and ranks
        trainer = Trainer.build(cfg, init_distributed(device_type, cfg.launch.collective_timeout_s))
        configure_logging(rank, cfg.monitor.all_ranks_log, console)
        if generation:
            from scaletrain.monitor import log

            log.info(
                "in-process restart: generation %d joined in %.2f s (pid %d kept its imports)",
                generation,
                time.perf_counter() - t0,
                os.getpid(),
            )
        pause = None
        if cfg.launch.fault_tolerance == "replicas":
            asked = pause_key(generation)
            pause = lambda: rank == 0 and process.store.check([asked])  # noqa: E731  the others learn by agreement
        summary = fit(trainer, console, pause=pause)
    except Paused:
        summary = None
        reported = paused_key(generation, rank)
    except BaseException as e:
        if not (isinstance(e, Exception) and peer_lost(e)):
            if not isinstance(e, SystemExit):
                log_exception(rank, e)
            _close(trainer)
            shutdown_distributed(wait_for_peers=False)
            raise  # this rank's own error: the process ends, and the launcher treats it as a lost rank
        sys.stderr.write(
            f"in-process restart: rank {rank} lost a peer in generation {generation} "
            f"({type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}); waiting for the next generation\n"
        )
        sys.stderr.flush()
        summary = None
        reported = left_key(generation, rank)
    if summary is None:
        # out of the except block, so the traceback (which holds every frame of the failed step) is gone
        _close(trainer)
        trainer = None
        _leave_group()
        process.store.set(reported, "")
        return
    _close(trainer)
    shutdown_distributed(wait_for_peers=True)
    process.store.set(done_key(generation, rank), json.dumps(summary) if rank == 0 else "")


def _close(trainer) -> None:
    """Stop the trainer's background threads (data read-ahead): the next generation builds its own."""
    if trainer is not None:
        trainer.loader.close()
        trainer.val_loader.close()


def _leave_group() -> None:
    """Drop every process group of the failed generation without waiting for the peer that is gone: NCCL's are
    aborted (a destroy would wait for the collective in flight), gloo's are destroyed (their sockets are closed)."""
    import gc

    import torch.distributed as dist

    _stop_checkpoint_writer()
    if not dist.is_initialized():
        return
    gc.collect()  # the failed generation's trainer, dropped by the caller
    # DTensor's caches keep the generation's meshes (they serve the next one: module docstring), and each mesh
    # holds its process groups: a gloo group closes its sockets only when the last reference goes, and until then a
    # peer blocked in a collective with this rank waits for it until the collective timeout (eager code finds the
    # groups by name, never through these references)
    from torch.distributed.device_mesh import DeviceMesh

    for obj in gc.get_objects():
        if isinstance(obj, DeviceMesh):
            getattr(obj, "_pg_registry", {}).clear()
    if dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()
    gc.collect()


def _stop_checkpoint_writer() -> None:
    """Kill the async checkpoint writer process of the failed generation (checkpoint/async_writer.py): its gloo
    group had the dead rank in it, and the next generation's manager must start its own with every rank (a writer
    left registered here would skip the start-up broadcast the new rank joins, and both would wait forever). A save
    it had not committed stays a .partial folder, which the next manager removes."""
    import multiprocessing
    import threading

    from torch.distributed.checkpoint import _async_process_executor as process_executor

    # the writer is this worker's only child process; killed while it starts, its starting thread fails (EOF on
    # its pipe) instead of registering it after this function returned
    for child in multiprocessing.active_children():
        child.kill()
        child.join()
    for thread in threading.enumerate():
        if thread.name == "scaletrain-ckpt-writer-start":
            thread.join(timeout=30)
    writer, process_executor._CHECKPOINT_PROCESS = process_executor._CHECKPOINT_PROCESS, None
    if writer is not None and writer._save_process.is_alive():
        writer._save_process.kill()
        writer._save_process.join()
