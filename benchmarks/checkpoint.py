"""Checkpoints, measured: the training stall per save (async against sync), save and restore throughput over a
range of checkpoint sizes, and the recovery time from a SIGKILL of a rank to the first step after the restart.

    python benchmarks/checkpoint.py                      # 2 CPU ranks over gloo, 4 sizes ~1-290 MB, 3 reps
    python benchmarks/checkpoint.py --markdown BENCHMARKS.md
    python benchmarks/checkpoint.py --parts stall --models tiny,small --reps 5

Stall and throughput (one torchrun launch of this file with --worker, 2 gloo ranks): every model is built the way
`scaletrain train` builds it (config, preflight, meta model, parallelism, optimizer, data loader) and trained with
two CheckpointManagers, one with checkpoint.async_save=false and one with true. Each rep runs one save cycle of
each, order alternated: save, then --steps-per-save training steps with poll() after each, then finish_pending().
**Stall** is the wall time the training thread spends in save(), waiting for the staging copy (before the next
optimizer step), poll() and finish_pending() in that cycle (the slowest rank's); the step columns compare the steps
after a sync save with those run while an async write is in flight (staging wait left out); **save MB/s** is the committed checkpoint's bytes over the sync stall; **restore MB/s** the same
bytes over restore() (rank 0 verifies every sha256 first, as on resume).

Recovery: the real `scaletrain train` (2 CPU ranks, launch.max_restarts=1, a checkpoint every --interval steps) is
SIGKILLed on one rank once --kill-at steps are logged; the clock runs from the kill to the first metrics.jsonl row
of a step after the one it resumed from. benchmarks/probe/sitecustomize.py stamps each rank's start, process
group, and restore, which splits it; the same run's first start (launch to the row of step 1) is the baseline.
--restart-modes sets them side by side: process, in-process, replicas (2 DDP replicas, launch.fault_tolerance).

Goodput (--parts goodput): the same job for --goodput-s seconds from its first step (600: ten minutes), a random
rank SIGKILLed every --kill-every-s (120), in each restart mode, beside an undisturbed run for as long: the steps
each had trained when stopped, over the undisturbed run's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ helpers import each other by name

import sections  # the shared BENCHMARKS.md section writer
from peers import PROBE, machine  # noqa: E402  (the probe and machine line benchmarks/peers.py uses)

SECTION = "## Checkpoints: save stall, throughput, recovery"
TARGET_STALL = 0.10  # issue 19: async stall at most 10 % of the sync save's
# recovery modes: the launch overrides of each (replicas: the ranks are 2 DDP replicas, the lost one's is refilled
# while the other trains on)
RESTART_MODES = {
    "process": ["launch.restart=process"],
    "in-process": ["launch.restart=in-process"],
    "replicas": ["launch.restart=in-process", "launch.fault_tolerance=replicas", "parallel.dp_replicate=2"],
}
MODELS = "tiny:dim=64:n_layers=1,tiny,small,base"  # ~1, 10, 72 and 290 MB of model + AdamW state


def model_overrides(spec: str) -> list[str]:
    """`small` or `tiny:dim=64:n_layers=1` -> config overrides."""
    name, *changes = spec.split(":")
    return [f"model.name={name}", *(f"model.{c}" for c in changes)]


def job_overrides(a) -> list[str]:
    return [
        f"data.seq_len={a.seq_len}",
        f"train.global_batch_size={a.global_batch}",
        f"data.max_bytes={a.max_bytes}",
        "train.warmup_steps=1",
    ]


# ---------------------------------------------------------------- stall and throughput: one rank of the worker


def _build(overrides: list[str]):
    """The trainer `scaletrain train` builds (Trainer.build), and the manifest entry its checkpoints carry."""
    from scaletrain.config import load_config
    from scaletrain.train import Trainer

    trainer = Trainer.build(load_config(None, overrides))
    info = {
        "layout": trainer.layout.describe_mesh(),
        "world_size": trainer.rt.world_size,
        "model": trainer.cfg.model.name,
        "model_spec": trainer.spec.manifest(),
    }
    return trainer, info


def measure_model(spec: str, w: dict, root: Path) -> dict:
    """One model: alternating sync and async save cycles, then restores; times are the slowest rank's (s)."""
    import torch
    import torch.distributed as dist

    from scaletrain.checkpoint import CheckpointManager, list_checkpoints, read_manifest, verify

    trainer, info = _build(model_overrides(spec) + w["job"])
    cfg, rt, job = trainer.cfg, trainer.rt, trainer.job
    params = trainer.spec.num_params()
    managers = {
        # interval_steps=1: a manager opens its async writer (and writer process) only when it will save
        mode: CheckpointManager(
            cfg.checkpoint.model_copy(update={"async_save": mode == "async", "interval_steps": 1}),
            root / mode,
            rt.rank,
            rt.world_size,
            info,
        )
        for mode in ("sync", "async")
    }
    step = 0

    def train_step() -> float:
        nonlocal step
        t0 = time.perf_counter()
        step += 1
        trainer.train_step(step)
        return time.perf_counter() - t0

    trainer_state = trainer.state_dict

    train_step()  # AdamW creates its state on the first step: a checkpoint without it would be a third the size
    # the writer process starts in the background when the manager opens; a run saves first after
    # checkpoint.interval_steps, a cycle here at once: wait for it (reported beside the table, not in the ratio)
    writer_start_s = managers["async"].writer_ready()
    dist.barrier()
    out: dict = {key: {"sync": [], "async": []} for key in ("save_s", "staging_s", "commit_s", "step_s")}
    for rep in range(w["reps"]):
        for mode in ("sync", "async") if rep % 2 == 0 else ("async", "sync"):  # drift hits both alike
            mgr = managers[mode]
            staged_before = mgr.staging_wait_s
            t0 = time.perf_counter()
            mgr.save(step, job.model, job.optimizer, trainer_state())
            save_s, commit_s = time.perf_counter() - t0, 0.0
            steps = []
            for _ in range(w["steps_per_save"]):
                steps.append(train_step())  # async: the first waits for the staging copy before its update
                t0 = time.perf_counter()
                mgr.poll(step)  # as the loop does after each step
                commit_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            mgr.finish_pending()  # a write still running at the cycle's end stalls training here: counted
            commit_s += time.perf_counter() - t0
            staging_s = mgr.staging_wait_s - staged_before
            out["save_s"][mode].append(save_s)
            out["staging_s"][mode].append(staging_s)
            out["commit_s"][mode].append(commit_s)
            out["step_s"][mode].append((sum(steps) - staging_s) / len(steps))  # the staging wait is stall
    restore_s = []
    for _ in range(w["reps"]):
        dist.barrier()
        t0 = time.perf_counter()
        managers["sync"].restore(job.model, job.optimizer)
        restore_s.append(time.perf_counter() - t0)
    out["restore_s"] = restore_s
    newest = list_checkpoints(root / "sync")[0]
    out["bytes"] = read_manifest(newest)["bytes"]
    t0 = time.perf_counter()
    verify(newest, checksums=True)  # what restore's sha256 check costs on its own (rank 0 does it on resume)
    out["verify_s"] = time.perf_counter() - t0
    for mgr in managers.values():
        mgr.close()

    def slowest(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    for key in ("save_s", "staging_s", "commit_s", "step_s"):
        out[key] = {m: slowest(v) for m, v in out[key].items()}
    out["restore_s"] = slowest(out["restore_s"])
    out.update(
        model=spec,
        params=params,
        layout=info["layout"],
        writer=cfg.checkpoint.async_writer,
        writer_wait_s=writer_start_s,
    )
    return out


def worker(spec_path: str) -> None:
    """One rank under torchrun: measure every model in turn; rank 0 writes the results."""
    from same_job import leave_process_group

    w = json.loads(Path(spec_path).read_text())
    results = []
    for i, spec in enumerate(w["models"]):
        results.append(measure_model(spec, w, Path(w["root"]) / f"m{i}"))
        print(f"  {spec}: done", file=sys.stderr, flush=True)
    if int(os.environ["RANK"]) == 0:
        Path(w["out"]).write_text(json.dumps(results))
    leave_process_group()


def run_worker(a, workdir: Path, env: dict) -> list[dict]:
    spec = workdir / "spec.json"
    out = workdir / "results.json"
    spec.write_text(
        json.dumps(
            {
                "models": a.models,
                "job": job_overrides(a),
                "reps": a.reps,
                "steps_per_save": a.steps_per_save,
                "root": str(workdir / "ckpt"),
                "out": str(out),
            }
        )
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:0",
        str(Path(__file__).resolve()),
        "--worker",
        str(spec),
    ]
    proc = subprocess.run(
        cmd, env=env, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=a.timeout
    )
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"checkpoint worker exited {proc.returncode}; last output:\n{proc.stdout[-3000:]}")
    return json.loads(out.read_text())


def _stalls(r: dict, mode: str) -> list[float]:
    """Per rep: seconds the training thread spent in save(), waiting for staging, poll() and finish_pending()."""
    return [sum(x) for x in zip(r["save_s"][mode], r["staging_s"][mode], r["commit_s"][mode])]


def stall_table(results: list[dict]) -> list[str]:
    def ms(values) -> str:
        return f"{statistics.median(values) * 1e3:,.0f}"

    head = (
        "| model | checkpoint (MB) | sync: stall (ms) | async: save() (ms) | async: staging wait (ms) | "
        "async: write wait (ms) | async: stall (ms) | async ÷ sync | each rep | target ≤ 0.10 | "
        "step (ms), after a sync save | step (ms), async write in flight | step ratio (≤ 1.05) |"
    )
    out = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in results:
        sync, asyn = _stalls(r, "sync"), _stalls(r, "async")
        ratio = statistics.median(asyn) / statistics.median(sync)
        each = " ".join(f"{x / y:.2f}" for x, y in zip(asyn, sync))  # the two cycles of a rep ran back to back
        step_ratio = statistics.median(r["step_s"]["async"]) / statistics.median(r["step_s"]["sync"])
        out.append(
            "| "
            + " | ".join(
                [
                    r["model"],
                    f"{r['bytes'] / 1e6:,.1f}",
                    ms(sync),
                    ms(r["save_s"]["async"]),
                    ms(r["staging_s"]["async"]),
                    ms(r["commit_s"]["async"]),
                    ms(asyn),
                    f"{ratio:.3f}",
                    each,
                    "met" if ratio <= TARGET_STALL else "**not met**",
                    ms(r["step_s"]["sync"]),
                    ms(r["step_s"]["async"]),
                    f"{step_ratio:.2f}",
                ]
            )
            + " |"
        )
    return out


def throughput_table(results: list[dict]) -> list[str]:
    med = statistics.median
    head = (
        "| model | params (M) | checkpoint (MB) | save (s) | save MB/s | restore (s) | restore MB/s | "
        "of restore: sha256 verify (s) |"
    )
    out = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in results:
        mb = r["bytes"] / 1e6
        save = med(_stalls(r, "sync"))
        restore = med(r["restore_s"])
        out.append(
            "| "
            + " | ".join(
                [
                    r["model"],
                    f"{r['params'] / 1e6:.2f}",
                    f"{mb:,.1f}",
                    f"{save:.3f}",
                    f"{mb / save:,.0f}",
                    f"{restore:.3f}",
                    f"{mb / restore:,.0f}",
                    f"{r['verify_s']:.3f}",
                ]
            )
            + " |"
        )
    return out


# ---------------------------------------------------------------- recovery: the real CLI, a rank SIGKILLed


def _rows(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x).get("step", 0) for x in path.read_text().splitlines() if x.endswith("}")]


def _heartbeat_pids(run: Path) -> dict[int, int]:
    pids = {}
    for f in (run / "heartbeat").glob("rank*.json"):
        try:
            record = json.loads(f.read_text())
        except (OSError, ValueError):  # replaced while read: the next poll sees it
            continue
        pids[record["rank"]] = record["pid"]
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has exited; the agent reaps it later


def _events(folder: Path, pid: int, after: float = 0.0) -> dict:
    """Each event's first stamp later than unix time `after` (an in-process survivor stamps each generation)."""
    path = folder / f"events-{pid}.jsonl"
    if not path.is_file():
        return {}
    out: dict = {}
    for e in map(json.loads, path.read_text().splitlines()):
        if e["unix"] > after:
            out.setdefault(e["event"], e)
    return out


# (label, the mark that ends the phase); a phase starts at the previous mark the run has ("launch": the command's
# launch for a fresh start, the SIGKILL for a recovery; a fresh start has no "stopped")
RECOVERY_PHASES = [
    ("old ranks stopped (failure noticed)", "stopped"),
    ("ranks started (fresh: CLI + agent; restart: agent's new round)", "start"),
    ("imports (spawn, torch, scaletrain, config)", "process_group_call"),
    ("process group (gloo, both ranks)", "process_group"),
    ("build model, optimizer, data", "restore_start"),
    ("restore (sha256 verify + DCP load)", "restore_end"),
    ("first step, to its metrics row", "row"),
]


def train_command(a, name: str, steps: int, launch: list[str]) -> list[str]:
    """The `scaletrain train` command of a recovery or goodput run on 2 CPU ranks: the job, a metrics row every
    step, --interval's checkpoints and --memory-interval's snapshots, --set, then `launch` (restart mode, layout)."""
    return [
        sys.executable,
        "-m",
        "scaletrain.cli.main",
        "train",
        *model_overrides(a.recovery_model),
        *job_overrides(a),
        f"train.steps={steps}",
        "monitor.log_interval=1",
        f"checkpoint.interval_steps={a.interval}",
        f"checkpoint.memory_interval_steps={a.memory_interval}",
        *a.set,
        *launch,
        "train.eval_interval=0",
        "train.eval_batches=1",
        "monitor.progress=false",
        f"run.name={name}",
        "--nproc-per-node",
        "2",
    ]


def recovery_run(a, rep: int, workdir: Path, env: dict, mode: str = "process") -> dict:
    """One `scaletrain train` (RESTART_MODES[`mode`]) SIGKILLed on --kill-rank: unix times of each mark, for its
    fresh start and its restart; the run is stopped once the first step after the restart is logged (nothing
    later is measured)."""
    name = f"recovery-{mode}{rep}"
    run, events = workdir / "runs" / name, workdir / f"events-{name}"
    events.mkdir()
    env = {**env, "SCALETRAIN_BENCH_EVENTS": str(events)}
    cmd = train_command(a, name, a.kill_at + 100, ["launch.max_restarts=1", *RESTART_MODES[mode]])
    log = workdir / f"{name}.log"
    deadline = time.monotonic() + a.timeout
    with open(log, "w") as out:
        fresh, again = {"launch": time.time()}, {}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=workdir, start_new_session=True)
        try:

            def wait(done, what: str):
                while not done():
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"recovery run {rep}: no {what} (exit {proc.returncode}); last output:\n"
                            f"{log.read_text()[-3000:]}"
                        )
                    time.sleep(0.01)  # 10 ms: the resolution of the marks the driver takes itself
                return time.time()

            fresh["row"] = wait(lambda: 1 in _rows(run), "metrics row of step 1")
            wait(lambda: max(_rows(run), default=0) >= a.kill_at, f"metrics row of step {a.kill_at}")
            old = _heartbeat_pids(run)
            killed_at_step = max(_rows(run))
            os.kill(old[a.kill_rank], signal.SIGKILL)
            again["launch"] = time.time()  # the kill starts the recovery clock
            # in-process: only the killed rank ends; the survivors stay
            stopping = [old[a.kill_rank]] if mode != "process" else list(old.values())
            again["stopped"] = wait(lambda: not any(map(_alive, stopping)), "exit of the old ranks")
            new_pid = {}

            def resumed_row() -> bool:
                pid = _heartbeat_pids(run).get(0)
                if pid is None:
                    return False
                # rank 0 restored after the kill (a new process, or in-process the same one in a new generation)
                restored = _events(events, pid, after=again["launch"]).get("restore_end", {})
                if restored:
                    new_pid["pid"] = pid
                    rows = _rows(run)
                    # in-process the PID stays: wait for rank 0 to drop the rows logged after the restored step
                    new_pid["truncated"] = new_pid.get("truncated") or max(rows, default=0) <= restored["step"]
                    return new_pid["truncated"] and any(s > restored["step"] for s in rows)
                return False

            again["row"] = wait(resumed_row, "metrics row after the restart")
        finally:
            _end_family(proc)
    fresh.update({k: e["unix"] for k, e in _events(events, old[0]).items()})
    # a survivor's or a warm spare's marks from before the kill belong to the first start
    again.update({k: e["unix"] for k, e in _events(events, new_pid["pid"], after=again["launch"]).items()})
    return {
        "fresh": fresh,
        "again": again,
        "killed_at_step": killed_at_step,
        "resumed_from": _events(events, new_pid["pid"], after=again["launch"])["restore_end"]["step"],
    }


# the layout each restart mode trains in (replicas: 2 DDP replicas); its goodput is against an undisturbed run of it
GOODPUT_LAYOUTS = {"replicas": ["parallel.dp_replicate=2"]}


def goodput_run(a, workdir: Path, env: dict, mode: str | None, layout: list[str], seed: int = 0) -> dict:
    """`scaletrain train` (RESTART_MODES[`mode`]; None: an undisturbed run of `layout`) for --goodput-s seconds
    from the first metrics row, a random rank SIGKILLed every --kill-every-s of them; then the whole run is stopped.
    Returns the steps it had trained (the newest metrics row: a restart drops the rows after the step it resumed
    from) and the kills."""
    import random

    name = f"goodput-{mode or 'undisturbed'}{'-' + '-'.join(layout).replace('=', '') if layout else ''}"
    run = workdir / "runs" / name
    restarts = int(a.goodput_s // a.kill_every_s) + 1 if mode else 0
    launch = [*layout, *(RESTART_MODES[mode] if mode else []), f"launch.max_restarts={restarts}"]
    cmd = train_command(a, name, 1_000_000, launch)
    log = workdir / f"{name}.log"
    pick, kills = random.Random(seed), 0
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=workdir, start_new_session=True)
        try:
            deadline = time.monotonic() + a.timeout
            while 1 not in _rows(run):  # the clock starts at the first step: start-up is the same for every mode
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"goodput run {name}: no first step (exit {proc.returncode}):\n{log.read_text()[-3000:]}"
                    )
                time.sleep(0.05)
            start = time.monotonic()
            next_kill = start + a.kill_every_s if mode else float("inf")
            while time.monotonic() < start + a.goodput_s:
                if proc.poll() is not None:
                    raise RuntimeError(f"goodput run {name} ended (exit {proc.returncode}):\n{log.read_text()[-3000:]}")
                if time.monotonic() >= next_kill:
                    pids = _heartbeat_pids(run)
                    live = sorted(r for r, pid in pids.items() if _alive(pid))
                    if live:
                        os.kill(pids[pick.choice(live)], signal.SIGKILL)
                        kills += 1
                    next_kill += a.kill_every_s
                time.sleep(0.05)
            trained = max(_rows(run), default=0)
        finally:
            _end_family(proc)
    return {"mode": mode, "layout": layout, "steps": trained, "kills": kills}


def _end_family(proc: subprocess.Popen) -> None:
    """SIGKILL a launch and every process it started (in-process ranks and spares run in process groups of their
    own), and wait for them, before the folder they write into is removed."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(family, timeout=30)


def goodput_table(runs: list[dict], a) -> list[str]:
    clean = {" ".join(r["layout"]): r["steps"] for r in runs if r["mode"] is None}
    out = [
        f"**Goodput** (`scaletrain train`, model {a.recovery_model}, 2 CPU ranks, {a.goodput_s:.0f} s from the first "
        f"step, a random rank SIGKILLed every {a.kill_every_s:.0f} s; checkpoint every {a.interval} steps (async), "
        f"host-memory snapshot every {a.memory_interval}; steps trained ÷ those of the undisturbed run of the same "
        f"layout in the same time).",
        "",
        "| run | kills | steps trained | goodput |",
        "|---|---|---|---|",
    ]
    for r in runs:
        label = "undisturbed" if r["mode"] is None else ", ".join(RESTART_MODES[r["mode"]])
        label += f" ({', '.join(r['layout'])})" if r["layout"] and r["mode"] != "replicas" else ""
        out.append(f"| {label} | {r['kills']} | {r['steps']} | {r['steps'] / clean[' '.join(r['layout'])]:.2f} |")
    return out


def phases(marks: dict) -> list[float | None]:
    """Seconds of each RECOVERY_PHASES phase (None where the run has no such mark), then the total."""
    out, previous = [], marks["launch"]
    for _, mark in RECOVERY_PHASES:
        if mark not in marks:
            out.append(None)
            continue
        out.append(marks[mark] - previous)
        previous = marks[mark]
    return out + [marks["row"] - marks["launch"]]


def recovery_table(runs: list[dict]) -> list[str]:
    fresh = list(zip(*(phases(r["fresh"]) for r in runs)))  # per phase: one value per run
    again = list(zip(*(phases(r["again"]) for r in runs)))

    def median(values) -> str:
        got = [v for v in values if v is not None]
        return f"{statistics.median(got):.2f}" if got else "—"

    head = "| phase | fresh start (s) | recovery after SIGKILL (s) | recovery, each run (s) |"
    out = [head, "|---|---|---|---|"]
    labels = [label for label, _ in RECOVERY_PHASES] + ["**total** (launch / kill → first step's metrics row)"]
    for label, f, g in zip(labels, fresh, again):
        each = " ".join("—" if v is None else f"{v:.2f}" for v in g)
        out.append(f"| {label} | {median(f)} | {median(g)} | {each} |")
    ratio = statistics.median(again[-1]) / statistics.median(fresh[-1])
    out.append(f"| recovery ÷ fresh start (total) | — | {ratio:.2f} | |")
    return out


def modes_table(by_mode: dict[str, list[dict]]) -> list[str]:
    """Kill → next metrics row of each restart mode beside a fresh start (launch → step 1's row, every run's)."""
    fresh = statistics.median(r["fresh"]["row"] - r["fresh"]["launch"] for runs in by_mode.values() for r in runs)
    out = [
        "**Recovery side by side** (medians; fresh start: launch → first metrics row over every run above).",
        "",
        "| | seconds | ÷ fresh start |",
        "|---|---|---|",
        f"| fresh start | {fresh:.2f} | 1.00 |",
    ]
    for mode, runs in by_mode.items():
        took = statistics.median(r["again"]["row"] - r["again"]["launch"] for r in runs)
        out.append(f"| {', '.join(RESTART_MODES[mode])}: kill → next metrics row | {took:.2f} | {took / fresh:.2f} |")
    return out


# ---------------------------------------------------------------- driver


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="stall,recovery", help="stall (also gives throughput), recovery and/or goodput")
    ap.add_argument(
        "--models", default=MODELS, help="comma-separated presets, each with optional :field=value model overrides"
    )
    ap.add_argument("--reps", type=int, default=3, help="save cycles per mode and model; recovery runs")
    ap.add_argument(
        "--steps-per-save",
        type=int,
        default=5,
        help="training steps after each save; an async write still running after them is waited for (counted as stall)",
    )
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--max-bytes", type=int, default=300_000, help="stdlib text read as the token stream")
    ap.add_argument("--recovery-model", default="small", help="model of the recovery runs (preset[:overrides])")
    ap.add_argument("--interval", type=int, default=5, help="recovery: checkpoint.interval_steps")
    ap.add_argument(
        "--memory-interval", type=int, default=0, help="recovery: checkpoint.memory_interval_steps (0: none)"
    )
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="recovery: one more config override (repeat)"
    )
    ap.add_argument("--kill-at", type=int, default=13, help="recovery: SIGKILL once this step is logged")
    ap.add_argument("--kill-rank", type=int, default=1, choices=[0, 1])
    ap.add_argument(
        "--restart-modes",
        default="process,in-process",
        help="recovery, side by side: launch.restart values, and replicas (in-process with "
        "launch.fault_tolerance=replicas on 2 DDP replicas: the other replica trains on; needs --memory-interval)",
    )
    ap.add_argument("--goodput-s", type=float, default=600, help="goodput: seconds of training measured per run")
    ap.add_argument("--kill-every-s", type=float, default=120, help="goodput: a random rank SIGKILLed this often")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every rank")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one launch may take")
    ap.add_argument("--markdown", type=Path, help=f"also write the tables into this file's '{SECTION}' section")
    ap.add_argument("--note", default="", help="a line for the report, e.g. what else ran on the machine")
    ap.add_argument("--keep", type=Path, help="work in this new folder and keep it (run folders, logs)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # a rank of the stall/throughput launch
    a = ap.parse_args(argv)
    a.parts = a.parts.split(",")
    for part in a.parts:
        if part not in ("stall", "recovery", "goodput"):
            ap.error(f"--parts: unknown part {part!r}; choose from stall, recovery, goodput")
    if "goodput" in a.parts and not 0 < a.kill_every_s < a.goodput_s:
        ap.error("--kill-every-s: must be more than 0 and less than --goodput-s")
    a.models = a.models.split(",")
    a.restart_modes = a.restart_modes.split(",")
    for mode in a.restart_modes:
        if mode not in RESTART_MODES:
            ap.error(f"--restart-modes: unknown mode {mode!r}; choose from {', '.join(RESTART_MODES)}")
    if "replicas" in a.restart_modes and a.memory_interval < 1:
        ap.error("--restart-modes replicas: set --memory-interval (the replicas hand over their state in host memory)")
    if a.reps < 1 or a.steps_per_save < 1:
        ap.error("--reps and --steps-per-save: need at least 1")
    if a.global_batch % 2:
        ap.error(f"--global-batch {a.global_batch} must be a multiple of 2 (the ranks)")
    if a.kill_at <= a.interval + 2:  # leave the first async save a few steps to be written and committed
        ap.error(f"--kill-at {a.kill_at}: must be past the first committed checkpoint, > --interval + 2")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.worker:
        worker(a.worker)
        return
    # probe first on the path: its sitecustomize stamps the recovery runs' ranks (no-op without its env vars)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(a.threads),
        "PYTHONPATH": os.pathsep.join(p for p in (str(PROBE), os.environ.get("PYTHONPATH")) if p),
    }
    report, load = [], os.getloadavg()
    with contextlib.ExitStack() as stack:
        if a.keep:  # the runs' folders and logs stay for reading
            a.keep.mkdir(parents=True, exist_ok=False)
            tmp = str(a.keep)
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="scaletrain-ckpt-bench-"))
        if "stall" in a.parts:
            print("stall and throughput: one launch, every model", file=sys.stderr, flush=True)
            results = run_worker(a, Path(tmp), env)
            r0 = results[0]
            title = (
                f"2 CPU ranks (gloo), {r0['layout']}, fp32, AdamW; {a.global_batch} x {a.seq_len} tokens per "
                f"step; {a.reps} alternating reps of each mode, {a.steps_per_save} steps per save; async writer: "
                f"{r0['writer']}; "
                f"checkpoints on {_filesystem(Path(tmp))}"
            )
            waited = ", ".join(f"{r['model']} {r['writer_wait_s']:.1f}" for r in results)
            report += [
                f"**Training stall per save, async against sync** ({title}).",
                "",
                *stall_table(results),
                "",
                f"The writer process starts in the background when the checkpoint manager opens; the cycles began "
                f"after a first training step, and waited for it that much longer (s): {waited}.",
                "",
                "**Save and restore throughput** (sync saves of the runs above; restore reads what the last "
                "save wrote, from the page cache).",
                "",
                *throughput_table(results),
                "",
            ]
        if "recovery" in a.parts:
            by_mode: dict[str, list[dict]] = {}
            for rep in range(a.reps):
                for mode in a.restart_modes:  # interleaved: a drift in the machine's load hits every mode alike
                    print(f"recovery {rep + 1}/{a.reps}, {mode}", file=sys.stderr, flush=True)
                    by_mode.setdefault(mode, []).append(recovery_run(a, rep, Path(tmp), env, mode))
            # the launch overrides --set gave (launch.spares and the like), else the default spare
            spares = ", ".join(a.set) if a.set else "launch.spares=1"
            for mode, runs in by_mode.items():
                lost = " ".join(f"{r['killed_at_step']}→{r['resumed_from']}" for r in runs)
                report += [
                    f"**Recovery from SIGKILL of rank {a.kill_rank}, {', '.join(RESTART_MODES[mode])}** (`scaletrain train`, "
                    f"model {a.recovery_model}, 2 CPU ranks, checkpoint every {a.interval} steps (async), "
                    f"launch.max_restarts=1, {spares}, {a.reps} runs; killed after step → resumed from "
                    f"step: {lost}).",
                    "",
                    *recovery_table(runs),
                    "",
                ]
            report += [*modes_table(by_mode), ""]
        if "goodput" in a.parts:
            good = []
            layouts = {" ".join(GOODPUT_LAYOUTS.get(m, [])): GOODPUT_LAYOUTS.get(m, []) for m in a.restart_modes}
            for mode, layout in [
                *((None, x) for x in layouts.values()),
                *((m, GOODPUT_LAYOUTS.get(m, [])) for m in a.restart_modes),
            ]:
                print(f"goodput, {mode or 'undisturbed'} {' '.join(layout)}", file=sys.stderr, flush=True)
                good.append(goodput_run(a, Path(tmp), env, mode, layout))
            report += [*goodput_table(good, a), ""]
    # other jobs on a shared machine slow both modes but blur the split: say how loaded it was
    report += [
        f"Load average (1 min) at start and end: {load[0]:.1f}, {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.",
        "",
    ]
    print("\n".join(report))
    if a.markdown:
        write_section(a.markdown, report, a, argv)


def _filesystem(path: Path) -> str:
    """The mount (device and type) holding `path`, from /proc/mounts: what the MB/s figures are of."""
    best = ("", "?", "?")
    for line in Path("/proc/mounts").read_text().splitlines():
        dev, mnt, kind = line.split()[:3]
        if str(path.resolve()).startswith(mnt) and len(mnt) >= len(best[0]):
            best = (mnt, dev, kind)
    return f"{best[1]} ({best[2]})"


def write_section(path: Path, report: list[str], a, argv: list[str] | None) -> None:
    """Replace this benchmark's section of `path` (from SECTION to the next '## ' heading), or append it; the rest
    of the file, hand-written notes included, stays as it is."""
    sections.write_section(
        path,
        SECTION,
        "benchmarks/checkpoint.py",
        argv,
        report,
        machine(),
        a.note,
        "How each figure is measured: benchmarks/checkpoint.py's docstring and benchmarks/README.md.",
    )


if __name__ == "__main__":
    main()
