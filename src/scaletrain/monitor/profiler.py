"""A torch.profiler window at chosen steps: `wait` idle steps, `warmup` steps, then `active` recorded steps
ending in one Chrome trace per rank (profile/rank{R}_step{S}.pt.trace.json, open in Perfetto or chrome://tracing)
and the rank's top operators by self time (profile/top_ops_rank{R}.json), which the diagnosis lists."""

from __future__ import annotations

import json
from pathlib import Path

import torch


class ProfilerWindow:
    def __init__(
        self,
        out_dir: Path,
        rank: int,
        device: torch.device,
        first_step: int,
        at_step: int,
        wait: int,
        warmup: int,
        active: int,
        timer=None,
    ):
        """at_step: first recorded (active) step; first_step: the step the loop runs first (after a resume)."""
        from torch.profiler import ProfilerActivity, profile, schedule

        self.out_dir, self.rank, self.timer = out_dir, rank, timer
        self.cuda = device.type == "cuda"
        self.first_active = at_step
        self.last_active = at_step + active - 1
        skip = at_step - warmup - wait - first_step
        self.enabled = skip >= 0
        if not self.enabled:
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._step = first_step
        self._prof = profile(
            activities=activities,
            on_trace_ready=self._ready,
            schedule=schedule(skip_first=skip, wait=wait, warmup=warmup, active=active, repeat=1),
        )
        self._prof.start()
        self._label(first_step)

    def _label(self, step: int) -> None:
        if self.timer is not None:
            self.timer.label_ops = self.first_active - 1 <= step <= self.last_active

    def _ready(self, prof) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.out_dir / f"rank{self.rank}_step{self.first_active}.pt.trace.json"))
        key = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        rows = []
        for ev in prof.key_averages():
            t = getattr(ev, key, 0.0) or 0.0
            if ev.key.startswith("scaletrain.") or ev.key.startswith("ProfilerStep"):
                continue  # our own phase labels, not kernels
            rows.append({"name": ev.key, "self_time_us": float(t), "calls": int(ev.count)})
        rows.sort(key=lambda r: -r["self_time_us"])
        total = sum(r["self_time_us"] for r in rows) or 1.0
        top = [{**r, "share": r["self_time_us"] / total} for r in rows[:15]]
        (self.out_dir / f"top_ops_rank{self.rank}.json").write_text(
            json.dumps(
                {
                    "rank": self.rank,
                    "steps": [self.first_active, self.last_active],
                    "time": "device" if self.cuda else "cpu",
                    "ops": top,
                },
                indent=1,
            )
            + "\n"
        )

    def step(self, step: int) -> None:
        """Call after each optimizer step `step`."""
        if not self.enabled:
            return
        self._prof.step()
        self._label(step + 1)
        if step >= self.last_active:
            self.close()

    def close(self) -> None:
        if self.enabled:
            self.enabled = False
            if self.timer is not None:
                self.timer.label_ops = False
            self._prof.stop()
