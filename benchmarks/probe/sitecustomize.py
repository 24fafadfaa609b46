"""The one measurement every runner in benchmarks/peers.py gets, whoever wrote its loop.

peers.py puts this folder first on PYTHONPATH and sets SCALETRAIN_BENCH_PROBE=DIR, so Python imports this file at
start-up in every process of a runner's tree (launcher, agent, ranks). It does nothing until the process imports
torch.optim; then it registers a global optimizer step post-hook (torch.optim.optimizer.
register_optimizer_step_post_hook), which fires at the end of every optimizer.step() whatever wraps the optimizer
(DDP, FSDP2, Accelerate's AcceleratedOptimizer, Fabric's _FabricOptimizer). Only the first optimizer a process
steps counts, so a wrapper that steps an inner optimizer is counted once.

A process that steps writes DIR/rank<RANK>-<pid>.jsonl, one line per step, flushed as it goes:
  first line  {"rank", "pid", "first_step_unix": time.time() at the end of step 1, "threads": torch.get_num_threads()}
  then        [time.perf_counter() at the end of the step, resource.getrusage(RUSAGE_SELF).ru_maxrss in KiB]
ru_maxrss is the kernel's peak resident set of the process so far, so the last line holds the peak over training.
Nothing runs at exit (an atexit handler registered this early made gloo ranks hang at shutdown now and then).
Cost per step: a perf_counter(), a getrusage() and one small write.
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
_state: dict = {}


def _on_step(optimizer, args, kwargs) -> None:
    now = time.perf_counter()
    if not _state:
        import torch

        rank = int(os.environ.get("RANK", -1))
        _state.update(id=id(optimizer), file=open(os.path.join(_DIR, f"rank{rank}-{os.getpid()}.jsonl"), "w",
                                                  buffering=1))
        _state["file"].write(json.dumps({"rank": rank, "pid": os.getpid(), "first_step_unix": time.time(),
                                         "threads": torch.get_num_threads()}) + "\n")
    if id(optimizer) == _state["id"]:
        _state["file"].write(f"[{now}, {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}]\n")
        if _PROFILE:
            _profile_window(_state.setdefault("steps", 0) + 1)
            _state["steps"] += 1


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


class _HookOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Registers the hook right after torch.optim.optimizer has run, without importing torch any earlier."""

    TARGET = "torch.optim.optimizer"

    def find_spec(self, name, path=None, target=None):
        if name != self.TARGET:
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
        module.register_optimizer_step_post_hook(_on_step)


if _DIR:
    sys.meta_path.insert(0, _HookOnImport())
