"""Step-time breakdown: data wait, forward, backward, exposed communication, optimizer — per rank, cheap.

What is measured (seconds, per optimizer step, averaged over a logging window):
- data: host wall time in the loader's `next_step()` (on every device: a GPU idles while the host fetches).
- forward / backward / optimizer: wall time of those phases. On CPU ops are synchronous, so `perf_counter` bounds
  are exact. On CUDA a pair of `torch.cuda.Event`s brackets each phase; they are read (one synchronize) only at
  log steps, never in between.
- exposed communication: gradient reduction that compute did not hide. DDP reduces gradients inside backward and
  backward only returns once every bucket is reduced, so the time from the last gradient becoming ready
  (a post-accumulate-grad hook per parameter, observation only) to the end of backward is the exposed part,
  including any wait for slower peers. With DTensor parameters (FSDP2 calls those hooks itself after each
  reduce-scatter; TP reduces inside matmuls) the estimate is barrier-free instead: this rank's backward minus the
  fastest rank's backward (ranks run identical shapes), i.e. the time it waited in the gradient collectives for
  its peers; the reduction time every rank pays alike, and waits inside FSDP's forward all-gathers, are not
  separated there. Backward is reported without the exposed part.
- pipeline parallelism: the schedule interleaves passes, so forward is the stages' own forward time (module
  hooks), backward the rest of the schedule step (backward compute, point-to-point and bubble).
Per-rank vectors are combined only at log steps (one all-gather of a few floats): no collective per step.
"""

from __future__ import annotations

import resource
import time

import torch
import torch.distributed as dist

PHASES = ("data", "forward", "backward", "comm", "optimizer")
# layout of the per-rank vector gathered at log steps
_FIELDS = (
    "data",
    "forward",
    "backward",
    "comm",
    "optimizer",
    "fb",
    "pp_forward",
    "steps",
    "hooked",
    "peak_mem",
    "mem_capacity",
)


class _NullPhase:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NULL_PHASE = _NullPhase()


class NullTimer:
    """The timer used when the breakdown is off (and by callers that pass none): every phase is free."""

    enabled = False

    def phase(self, name: str):
        return _NULL_PHASE


NULL_TIMER = NullTimer()


class _Phase:
    """One named phase; re-entered every step. Host timing always; CUDA events too on a GPU."""

    __slots__ = ("timer", "name", "t0", "ev0", "ready", "_rf")

    def __init__(self, timer: StepTimer, name: str):
        self.timer, self.name, self.t0, self.ev0, self.ready = timer, name, 0.0, None, None

    def __enter__(self):
        tm = self.timer
        if tm.nvtx:
            torch.cuda.nvtx.range_push(self.name)
        if tm.label_ops:
            self._rf = torch.profiler.record_function(f"scaletrain.{self.name}")
            self._rf.__enter__()
        if self.name == "backward":
            tm.last_ready = 0.0
            if tm.cuda:
                tm.ready_event = torch.cuda.Event(enable_timing=True)
                tm.ready_hit = False
        tm.in_fb = self.name == "fb"
        if tm.cuda and self.name != "data":
            self.ev0 = torch.cuda.Event(enable_timing=True)
            self.ev0.record()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        tm = self.timer
        delay = tm.inject.get(self.name)
        if delay:
            # fault injection ($SCALETRAIN_FAULTS, tests only): the phase's own work takes longer, as on a slow device
            time.sleep(delay)
        t1 = time.perf_counter()
        if tm.cuda and self.name != "data":
            ev1 = torch.cuda.Event(enable_timing=True)
            ev1.record()
            ready = tm.ready_event if self.name == "backward" and tm.ready_hit else None
            tm.pending.append((self.name, self.ev0, ev1, ready))
        else:
            tm.acc[self.name] = tm.acc.get(self.name, 0.0) + (t1 - self.t0)
            if self.name == "backward" and tm.last_ready > self.t0:
                tm.acc["comm"] = tm.acc.get("comm", 0.0) + (t1 - tm.last_ready)
                tm.hooked = True
        tm.in_fb = False
        if self.name == "optimizer":
            tm.steps += 1  # one optimizer phase per step: the window's step count
        if tm.label_ops:
            self._rf.__exit__(None, None, None)
        if tm.nvtx:
            torch.cuda.nvtx.range_pop()
        return False


class StepTimer:
    """Accumulates phase times between log steps. `phase(name)` is a context manager; names: data, forward,
    backward, optimizer, fb (a pipeline schedule's whole forward+backward)."""

    enabled = True

    def __init__(
        self,
        device: torch.device,
        model: torch.nn.Module | None = None,
        nvtx: bool = False,
        inject: dict[str, float] | None = None,
        pipeline_stages: list[torch.nn.Module] | None = None,
    ):
        self.cuda = device.type == "cuda"
        self.device = device
        self.nvtx = nvtx and self.cuda
        self.label_ops = False  # set while a profiler window records, so phases show up in the trace
        self.inject = inject or {}
        self._phases: dict = {}
        self.acc: dict[str, float] = {}
        self.pending: list = []
        self.last_ready = 0.0
        self.ready_event = None
        self.ready_hit = False
        self.hooked = False
        self.in_fb = False
        self._pp_t0 = 0.0
        self.steps = 0
        self._handles: list = []
        if model is not None:
            self._install_hooks(model, pipeline_stages)

    def _install_hooks(self, model: torch.nn.Module, pipeline_stages: list[torch.nn.Module] | None) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        # FSDP2 calls these hooks itself after each reduce-scatter, and TP reduces inside the matmuls: with
        # DTensor parameters "last gradient ready" is not the end of compute, so those layouts use the peer estimate
        sharded = any(hasattr(p, "device_mesh") for p in params)
        for p in [] if sharded else params:
            try:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_ready))
            except (RuntimeError, AttributeError):
                pass
        if pipeline_stages:
            for part in pipeline_stages:
                self._handles.append(part.register_forward_pre_hook(self._pp_pre))
                self._handles.append(part.register_forward_hook(self._pp_post))

    def _grad_ready(self, _param) -> None:
        if self.cuda:
            if self.ready_event is not None:
                self.ready_event.record()
                self.ready_hit = True
        else:
            self.last_ready = time.perf_counter()

    def _pp_pre(self, *_):
        if self.in_fb:
            self._pp_t0 = time.perf_counter()

    def _pp_post(self, *_):
        if self.in_fb:
            self.acc["pp_forward"] = self.acc.get("pp_forward", 0.0) + time.perf_counter() - self._pp_t0

    def phase(self, name: str) -> _Phase:
        ph = self._phases.get(name)
        if ph is None:
            ph = self._phases[name] = _Phase(self, name)
        return ph

    def _resolve_cuda(self) -> None:
        if not self.pending:
            return
        torch.cuda.synchronize(self.device)
        for name, ev0, ev1, ready in self.pending:
            self.acc[name] = self.acc.get(name, 0.0) + ev0.elapsed_time(ev1) / 1e3
            if ready is not None:
                self.acc["comm"] = self.acc.get("comm", 0.0) + ready.elapsed_time(ev1) / 1e3
                self.hooked = True
        self.pending.clear()

    def window(self) -> torch.Tensor:
        """This rank's per-step means since the last call (see _FIELDS), then reset."""
        if self.cuda:
            self._resolve_cuda()
            peak = float(torch.cuda.max_memory_allocated(self.device))
            cap = float(torch.cuda.get_device_properties(self.device).total_memory)
        else:
            peak = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB
            cap = 0.0
        n = max(self.steps, 1)
        vec = [self.acc.get(k, 0.0) / n for k in _FIELDS[:7]] + [float(self.steps), float(self.hooked), peak, cap]
        self.acc.clear()
        self.steps = 0
        self.hooked = False
        return torch.tensor(vec, dtype=torch.float64)


def gather_windows(vec: torch.Tensor, device: torch.device) -> list[dict[str, float]]:
    """Every rank's window vector, on every rank (one all-gather; call on all ranks at log steps only)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        local = vec.to(device)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        rows = [p.cpu().tolist() for p in parts]
    else:
        rows = [vec.tolist()]
    return [dict(zip(_FIELDS, row, strict=True)) for row in rows]


def combine_ranks(rows: list[dict[str, float]], step_time_s: float) -> dict:
    """Rank-aggregated breakdown for one log record: rank means of each phase, per-rank busy/comm/memory, the
    straggler spread (slowest busy rank vs the median) and which rank that is."""
    hooked = all(r["hooked"] for r in rows)
    pp = any(r["fb"] > 0 for r in rows)
    if not hooked and not pp:
        fastest = min(r["backward"] for r in rows)
        for r in rows:
            r["comm"] = r["backward"] - fastest
    for r in rows:
        if pp:
            r["forward"] = r["pp_forward"]
            r["backward"] = max(r["fb"] - r["pp_forward"], 0.0)
        else:
            r["backward"] = max(r["backward"] - r["comm"], 0.0)
        r["busy"] = r["data"] + r["forward"] + r["backward"] + r["optimizer"]
    n = len(rows)
    means = {f"time_{k}_s": sum(r[k] for r in rows) / n for k in PHASES}
    out: dict[str, object] = {**means, "time_other_s": max(step_time_s - sum(means.values()), 0.0)}
    busy = [r["busy"] for r in rows]
    med = sorted(busy)[n // 2] if n % 2 else sum(sorted(busy)[n // 2 - 1 : n // 2 + 1]) / 2
    slowest = max(range(n), key=lambda i: busy[i])
    out.update(
        {
            "busy_s_per_rank": busy,
            "comm_s_per_rank": [r["comm"] for r in rows],
            "data_s_per_rank": [r["data"] for r in rows],
            "peak_mem_bytes_per_rank": [r["peak_mem"] for r in rows],
            "straggler_spread": (busy[slowest] - med) / med if med > 0 else 0.0,
            "slowest_rank": slowest,
            "comm_measure": "pipeline schedule" if pp else ("grad-ready hooks" if hooked else "peer difference"),
        }
    )
    if rows[0]["mem_capacity"] > 0:
        out["mem_capacity_bytes"] = rows[0]["mem_capacity"]
    if pp:
        fb = sum(r["fb"] for r in rows) / n
        fwd = sum(r["pp_forward"] for r in rows) / n
        # backward ~ 2x forward (the F:B = 1:2 convention the predicted bubble uses)
        out["pp_bubble_measured"] = max(0.0, 1.0 - 3.0 * fwd / fb) if fb > 0 else 0.0
    return out
