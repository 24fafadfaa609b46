"""The monitor the training loop drives: phase timer, sinks, device sampler, profiler window, MFU and the
end-of-run diagnosis, behind a handful of calls so the loop stays readable:

    run = begin_run(run_dir, rank, start_step)   # run_record.py: fresh or resumed, before any file is opened
    mon = TrainMonitor(cfg.monitor, MonitorContext(run_dir, run, ...))
    with mon.phase("data"): ...                  # also forward/backward inside forward_backward(timer=mon.timer)
    record = mon.on_log(record)                  # at log steps, on every rank (one small all-gather)
    mon.step_end(step)                           # profiler schedule
    mon.close()                                  # rank 0 writes monitor/diagnosis.json
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from scaletrain.config.schema import MonitorConfig
from scaletrain.monitor.diagnosis import Thresholds, diagnose, flagged
from scaletrain.monitor.faults import injected_delays
from scaletrain.monitor.metrics import read_jsonl
from scaletrain.monitor.progress import log
from scaletrain.monitor.run_record import RunRecord, from_rank0
from scaletrain.monitor.stragglers import StragglerWatch
from scaletrain.monitor.throughput import peak_flops
from scaletrain.monitor.timing import NULL_TIMER, StepTimer, combine_ranks, gather_windows

MFU_CONVENTION = (
    "model FLOPs/token (6N + 12·L·h·s, PaLM appendix B; no recompute) x tokens/s / "
    "(the job's dense peak for the compute dtype: the catalog's datasheet figure per GPU, else a matmul probe "
    "measured on this host; none known: no MFU)"
)


def thresholds(cfg) -> Thresholds:
    return Thresholds(**{k: getattr(cfg, k) for k in asdict(Thresholds())})


def read_samples(run_dir: Path) -> dict[int, list[dict]]:
    """rank -> its device samples, in time order. Folders written before each run started its files anew may hold
    several runs, one after the other, in one file: only the last (after the last step back in time) is read."""
    out = {}
    for path in sorted((Path(run_dir) / "monitor").glob("samples_rank*.jsonl")):
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a stopped run
        back = [i for i in range(1, len(rows)) if rows[i].get("t", 0) < rows[i - 1].get("t", 0)]
        rows = rows[back[-1] :] if back else rows
        out[int(path.stem.removeprefix("samples_rank"))] = rows
    return out


def read_top_ops(run_dir: Path) -> dict | None:
    path = Path(run_dir) / "profile" / "top_ops_rank0.json"
    return json.loads(path.read_text()) if path.is_file() else None


@dataclass(frozen=True)
class MonitorContext:
    """The run a TrainMonitor watches, beyond its [monitor] section: where its files go and from which step, which
    rank on which device, and the model trained (for the phase timer and MFU)."""

    out: Path  # the run folder
    run: RunRecord
    start_step: int  # the step the run resumed from (0: a fresh run)
    rank: int
    world_size: int
    device: torch.device
    model: torch.nn.Module
    flops_per_token: float | None  # model FLOPs of one token's forward + backward; None: no MFU
    dtype: str  # the compute dtype, whose peak FLOP/s MFU divides by
    layout: str  # the parallel layout, as meta.json names it
    pipeline_stages: tuple[torch.nn.Module, ...] = ()  # this rank's stages when a schedule runs them: timed by hooks
    pp_bubble: float | None = None  # the schedule's predicted idle share, reported beside the measured one


class TrainMonitor:
    def __init__(self, cfg: MonitorConfig, ctx: MonitorContext):
        """The monitor of one rank, built from its [monitor] section: phase timer, device sampler, profiler
        window, MFU; rank 0 writes monitor/meta.json."""
        self.cfg, self.out, self.run, self.rank, self.device = cfg, ctx.out, ctx.run, ctx.rank, ctx.device
        inject = injected_delays(ctx.rank)  # $SCALETRAIN_FAULTS, tests only; a malformed value fails every rank here
        stages = list(ctx.pipeline_stages) or None
        self.timer = (
            StepTimer(ctx.device, ctx.model, nvtx=cfg.nvtx, inject=inject, pipeline_stages=stages)
            if cfg.breakdown
            else NULL_TIMER
        )
        # rank 0 alone finds the peak (a probe on a host's first run): ranks sharing its cores would skew it
        self.peak, self.peak_source = from_rank0(lambda: peak_flops(ctx.device, ctx.dtype, ctx.world_size), ctx.rank)
        if ctx.rank == 0 and self.peak is None:
            log.warning("MFU —: %s", self.peak_source)
        self.flops_per_token = ctx.flops_per_token
        self.pp_bubble_predicted = ctx.pp_bubble
        self.stragglers = StragglerWatch(cfg.straggler_ratio, cfg.straggler_steps)
        self.sampler = self._open_sampler(ctx) if cfg.sample_interval_s > 0 else None
        self.profiler = self._open_profiler(ctx) if cfg.profile_at_step else None
        if ctx.rank == 0:
            self._write_meta(ctx)

    def _open_sampler(self, ctx: MonitorContext):
        from scaletrain.monitor.sampler import DeviceSampler

        return DeviceSampler(
            ctx.out / "monitor" / f"samples_rank{ctx.rank}.jsonl",
            ctx.rank,
            ctx.device,
            self.cfg.sample_interval_s,
            t0=ctx.run.started_at,
            append=ctx.run.continue_files,
        ).start()

    def _open_profiler(self, ctx: MonitorContext):
        from scaletrain.monitor.profiler import ProfilerWindow

        cfg = self.cfg
        return ProfilerWindow(
            ctx.out / "profile",
            ctx.rank,
            ctx.device,
            ctx.start_step + 1,
            cfg.profile_at_step,
            cfg.profile_wait,
            cfg.profile_warmup,
            cfg.profile_active,
            timer=self.timer if self.timer.enabled else None,
        )

    def _write_meta(self, ctx: MonitorContext) -> None:
        """monitor/meta.json: what the figures were measured on and against (rank 0)."""
        (ctx.out / "monitor").mkdir(parents=True, exist_ok=True)
        meta = {
            "device": ctx.device.type,
            "device_name": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "CPU",
            "world_size": ctx.world_size,
            "layout": ctx.layout,
            "dtype": ctx.dtype,
            "peak_flops": self.peak,
            "peak_source": self.peak_source,
            "flops_per_token": ctx.flops_per_token,
            "mfu_convention": MFU_CONVENTION,
            "pp_bubble_predicted": self.pp_bubble_predicted,
            "thresholds": asdict(thresholds(self.cfg)),
        }
        (ctx.out / "monitor" / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")

    def phase(self, name: str):
        return self.timer.phase(name)

    def on_log(self, record: dict) -> dict:
        """Add the time since the run started (`t_s`, seconds), MFU and the rank-aggregated breakdown to a log
        record. Call on every rank at log steps."""
        record["t_s"] = round(self.run.t(), 3)
        rate = units_per_s(record)
        if self.peak and self.flops_per_token and rate:
            record["mfu"] = rate * self.flops_per_token / self.peak
        if isinstance(self.timer, StepTimer):  # enabled: the breakdown is on
            rows = gather_windows(self.timer.window(), self.device)
            window_steps = int(rows[0]["steps"])
            record.update(combine_ranks(rows, record["step_time_s"]))
            self.stragglers.observe(record, window_steps)
            if self.pp_bubble_predicted is not None:
                record["pp_bubble_predicted"] = self.pp_bubble_predicted
        return record

    def headline(self, record: dict) -> str:
        """The live figures rank 0's progress shows next to loss and tokens/s."""
        parts = []
        if "mfu" in record:
            parts.append(f"MFU {record['mfu']:.2%}")
        elif self.flops_per_token and units_per_s(record) is not None:
            parts.append("MFU —")  # no known peak: said once at start-up, and why
        st = record.get("step_time_s")
        if st and "time_data_s" in record:
            parts.append(
                f"step {st * 1e3:.0f} ms (data {record['time_data_s'] / st:.0%}, comm {record['time_comm_s'] / st:.0%})"
            )
            if record.get("straggler_spread", 0) * 100 > self.cfg.straggler_pct:
                parts.append(f"slowest rank {record['slowest_rank']} +{record['straggler_spread']:.0%}")
        return "  ".join(parts)

    def step_end(self, step: int) -> None:
        if self.profiler is not None:
            self.profiler.step(step)

    def close(self, with_diagnosis: bool = True) -> list:
        """Stop sampling and profiling; on rank 0 (and if `with_diagnosis`) diagnose the run, log the findings,
        write diagnosis.json."""
        if self.sampler is not None:
            self.sampler.stop()
        if self.profiler is not None:
            self.profiler.close()
        if not with_diagnosis or self.rank != 0 or not (self.out / "metrics.jsonl").is_file():
            return []
        findings = diagnose(
            read_jsonl(self.out / "metrics.jsonl"),
            thresholds(self.cfg),
            read_samples(self.out),
            read_top_ops(self.out),
            self.pp_bubble_predicted,
        )
        (self.out / "monitor" / "diagnosis.json").write_text(
            json.dumps([f.to_dict() for f in findings], indent=1) + "\n"
        )
        for f in flagged(findings):
            log.warning("diagnosis: %s: %s. Suggestion: %s", f.title, f.evidence, f.suggestion)
        if not flagged(findings):
            log.info("diagnosis: no bottleneck found")
        return findings


def units_per_s(record: dict) -> float | None:
    """The task's throughput in a log record: `<unit>_per_s` (tokens_per_s for causal-lm, images_per_s for an image
    classifier); flops_per_token is then the task's FLOPs per that unit."""
    return next((v for k, v in record.items() if k.endswith("_per_s")), None)
