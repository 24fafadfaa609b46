"""Preemption: SIGTERM or SIGUSR1 asks the run to finish its step, save a checkpoint and exit EXIT_REQUEUE.

Schedulers send these before taking the machines back (Slurm's `--signal=B:USR1@120`, Kubernetes' SIGTERM before
the grace period ends, the torchrun agent's SIGTERM when it shuts its workers down). The flag is agreed across
ranks (a non-blocking all-reduce awaited one step later), so every rank saves the same step even if the signal
reached only some of them; the run stops at the end of the step after the one the signal arrived in.
"""

from __future__ import annotations

import signal

from scaletrain.exit_codes import EXIT_REQUEUE  # noqa: F401  (what a preempted rank exits with; tests read it here)

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionWatch:
    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> PreemptionWatch:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
