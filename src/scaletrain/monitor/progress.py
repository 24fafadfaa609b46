"""Rank-0 console output: a live progress bar on a terminal, plain log lines elsewhere (CI, files)."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

log = logging.getLogger("scaletrain")


def configure_logging(rank: int, all_ranks: bool, console: TextIO | None = None) -> None:
    """Rank 0 logs at INFO; other ranks only warnings and errors unless all_ranks. With `console` (the terminal,
    when stderr goes to a rank log) rank 0, or every rank with all_ranks, logs to both."""
    level = logging.INFO if rank == 0 or all_ranks else logging.WARNING
    prefix = f"[rank{rank}] " if all_ranks else ""
    streams = [sys.stderr] + ([console] if console is not None and (rank == 0 or all_ranks) else [])
    log.handlers[:] = [logging.StreamHandler(s) for s in streams]
    for handler in log.handlers:
        handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
    log.setLevel(level)
    log.propagate = False


class StepProgress:
    """Step, loss, tokens/s, the monitor's headline (MFU, step breakdown, straggler) and ETA. Bar on a terminal;
    on anything else a log line per update."""

    def __init__(
        self,
        total_steps: int,
        start_step: int,
        enabled: bool,
        bar: bool,
        console: TextIO | None = None,
        unit: str = "tok",
    ):
        """unit: what the throughput counts, as the line shows it (tok, img)."""
        self.enabled = enabled
        self.unit = unit
        self.total = total_steps
        self._bar = None
        if enabled and bar and (console or sys.stderr).isatty():
            from rich.console import Console

            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn(f"{{task.fields[tps]}} {unit}/s"),
                TextColumn("{task.fields[extra]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                transient=False,
                console=Console(file=console) if console is not None else None,
            )
            self._task = self._bar.add_task(
                "train", total=total_steps, completed=start_step, loss="-", tps="-", extra=""
            )
            self._bar.start()

    def update(self, step: int, loss: float, tokens_per_s: float, extra: str = "") -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=f"{loss:.4f}", tps=f"{tokens_per_s:,.0f}", extra=extra)
        else:
            log.info(
                "step %d/%d  loss %.4f  %s %s/s%s",
                step,
                self.total,
                loss,
                f"{tokens_per_s:,.0f}",
                self.unit,
                f"  {extra}" if extra else "",
            )

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(text)
        else:
            log.info("%s", text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
