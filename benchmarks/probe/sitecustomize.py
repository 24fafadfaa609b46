"""The one measurement every runner in benchmarks/peers.py gets, whoever wrote its loop.

peers.py puts this folder first on PYTHONPATH and sets SCALETRAIN_BENCH_PROBE=DIR, so Python imports this file at
start-up in every process of a runner's tree (launcher, agent, ranks). It does nothing until the process imports
torch.optim; then it registers a global optimizer step post-hook (torch.optim.optimizer.
register_optimizer_step_post_hook), which fires at the end of every optimizer.step() whatever wraps the optimizer
(DDP, FSDP2, Accelerate's AcceleratedOptimizer, Fabric's _FabricOptimizer). Only the first optimizer a process
steps counts, so a wrapper that steps an inner optimizer is counted once.

A process that steps writes DIR/rank<RANK>-<pid>.jsonl, one line per step, flushed as it goes:
  first line  {"rank", "pid", "first_step_unix": time.time() at the end of step 1, "threads": torch.get_num_threads()}
  then        [time.perf_counter() at the end of the step, resource.getrusage(RUSAGE_SELF).ru_maxrss in KiB,
               time.process_time(): CPU seconds of the process's threads so far]
ru_maxrss is the kernel's peak resident set of the process so far, so the last line holds the peak over training.
Nothing runs at exit (an atexit handler registered this early made gloo ranks hang at shutdown now and then).
Cost per step: a perf_counter(), a getrusage(), a process_time() and one small write.

With SCALETRAIN_BENCH_EVENTS=DIR (benchmarks/checkpoint.py's recovery runs) a rank process also appends
DIR/events-<pid>.jsonl: {"event", "rank", "unix": time.time()} for "start" (this file's import, about when the
interpreter started), "process_group_call" and "process_group" (init_process_group called, returned),
"restore_start" and "restore_end" (CheckpointManager.restore, with the step it resumed from). Each is one small
write outside the steps.
"""

import importlib.abc
import importlib.util
import json
import os
import resource
import sys
import time

_DIR = os.environ.get("SCALETRAIN_BENCH_PROBE")
_PROFILE = os.environ.get("SCALETRAIN_BENCH_CPROFILE")
_OPS = os.environ.get("SCALETRAIN_BENCH_OPS")
_EVENTS = os.environ.get("SCALETRAIN_BENCH_EVENTS")
_STARTED = time.time()
_state: dict = {}


def _on_step(optimizer, args, kwargs) -> None:
    now = time.perf_counter()
    if not _state:
        import torch

        rank = int(os.environ.get("RANK", -1))
        _state.update(
            id=id(optimizer), file=open(os.path.join(_DIR, f"rank{rank}-{os.getpid()}.jsonl"), "w", buffering=1)
        )
        _state["file"].write(
            json.dumps(
                {"rank": rank, "pid": os.getpid(), "first_step_unix": time.time(), "threads": torch.get_num_threads()}
            )
            + "\n"
        )
    if id(optimizer) == _state["id"]:
        use = resource.getrusage(resource.RUSAGE_SELF)
        _state["file"].write(f"[{now}, {use.ru_maxrss}, {time.process_time()}, {use.ru_minflt}, {use.ru_nivcsw}]\n")
        step = _state["steps"] = _state.get("steps", 0) + 1
        if _PROFILE:
            _profile_window(step)
        if _OPS:
            _ops_window(step)


def _profile_window(step: int) -> None:
    """With SCALETRAIN_BENCH_CPROFILE=A:B, cProfile the main thread from the end of step A to the end of step B
    and write DIR/rank<RANK>-<pid>.pstats (for `python benchmarks/peers.py --cprofile A:B`)."""
    import cProfile

    start, stop = (int(x) for x in _PROFILE.split(":"))
    if step == start:
        _state["profile"] = cProfile.Profile()
        _state["profile"].enable()
    elif step == stop and "profile" in _state:
        _state["profile"].disable()
        rank = int(os.environ.get("RANK", -1))
        _state["profile"].dump_stats(os.path.join(_DIR, f"rank{rank}-{os.getpid()}.pstats"))


def _ops_window(step: int) -> None:
    """With SCALETRAIN_BENCH_OPS=A:B, torch.profiler (CPU activities) from the end of step A to the end of step B;
    writes DIR/rank<RANK>-<pid>.ops.json: {op name: [calls, self CPU microseconds]} over those steps (for
    `python benchmarks/peers.py --ops A:B`, which compares them between runners)."""
    start, stop = (int(x) for x in _OPS.split(":"))
    if step == start:
        import torch.profiler

        _state["ops"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        _state["ops"].__enter__()
    elif step == stop and "ops" in _state:
        prof = _state.pop("ops")
        prof.__exit__(None, None, None)
        ops = {e.key: [e.count, e.self_cpu_time_total] for e in prof.key_averages()}
        rank = int(os.environ.get("RANK", -1))
        with open(os.path.join(_DIR, f"rank{rank}-{os.getpid()}.ops.json"), "w") as f:
            json.dump(ops, f)


def _event(name: str, **extra) -> None:
    rank = int(os.environ.get("RANK", -1))  # a spawned rank gets RANK after start-up: write "start" late
    if "events" not in _state:
        _state["events"] = open(os.path.join(_EVENTS, f"events-{os.getpid()}.jsonl"), "a", buffering=1)
        _state["events"].write(json.dumps({"event": "start", "rank": rank, "unix": _STARTED}) + "\n")
    _state["events"].write(json.dumps({"event": name, "rank": rank, "unix": time.time(), **extra}) + "\n")


def _time_process_group(dist) -> None:
    inner = dist.init_process_group

    def init_process_group(*args, **kwargs):
        _event("process_group_call")
        out = inner(*args, **kwargs)
        _event("process_group")
        return out

    dist.init_process_group = dist.distributed_c10d.init_process_group = init_process_group


def _time_restore(manager) -> None:
    inner = manager.CheckpointManager.restore

    def restore(self, *args, **kwargs):
        _event("restore_start")
        out = inner(self, *args, **kwargs)
        _event("restore_end", step=out.step if out is not None else 0)
        return out

    manager.CheckpointManager.restore = restore


class _HookOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Calls `then(module)` right after module `target` has run, without importing it (or torch) any earlier."""

    def __init__(self, target: str, then) -> None:
        self.target, self.then = target, then

    def find_spec(self, name, path=None, target=None):
        if name != self.target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        self._inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        self.then(module)


if _DIR:
    sys.meta_path.insert(
        0, _HookOnImport("torch.optim.optimizer", lambda m: m.register_optimizer_step_post_hook(_on_step))
    )
if _EVENTS:
    sys.meta_path.insert(0, _HookOnImport("torch.distributed", _time_process_group))
    sys.meta_path.insert(0, _HookOnImport("scaletrain.checkpoint.manager", _time_restore))
