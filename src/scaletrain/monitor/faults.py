"""Fault injection, FOR TESTING THE DIAGNOSIS ONLY: sleeps added inside timed phases, so a test can make the data
source or one rank slow on purpose. Set through an environment variable, never through the job config, so it
cannot end up in a user's TOML or in `scaletrain train --print-config`:

    SCALETRAIN_FAULTS="data_delay_ms=50,slow_rank=1,slow_rank_ms=80" scaletrain train ...

data_delay_ms: every rank sleeps this long in every data fetch; slow_rank, slow_rank_ms: that rank sleeps this long
in every forward pass (pipeline: every schedule step), like a slower device; perturb_rank, perturb_step: that rank
adds 1e-3 to one weight at that step, just before monitor.replica_check_interval's check (a silent error on one
replica); stop_step: every rank stops after that step as a preempted run does (a checkpoint, exit 75), the same
step on every rank (a test's reference run changes its layout there). The launcher's workers inherit the variable.
Unset (the default) means no fault; a malformed value is refused with one line."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

ENV = "SCALETRAIN_FAULTS"
KEYS = ("data_delay_ms", "slow_rank", "slow_rank_ms", "perturb_rank", "perturb_step", "stop_step")
_INTEGERS = ("slow_rank", "perturb_rank", "perturb_step", "stop_step")
EXAMPLE = "data_delay_ms=50,slow_rank=1,slow_rank_ms=80"


def parse_faults(text: str) -> dict[str, float]:
    """'key=value,...' -> {key: value}; ValueError (one line naming the variable) for anything else."""
    faults: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or key not in KEYS:
            raise ValueError(
                f"{ENV}: {item!r} is not one of {', '.join(k + '=N' for k in KEYS)} "
                f"(testing only; e.g. {ENV}={EXAMPLE!r})"
            )
        try:
            number = int(value) if key in _INTEGERS else float(value)
        except ValueError:
            number = math.nan
        if not (math.isfinite(number) and number >= 0):
            kind = "an integer >= 0" if key in _INTEGERS else "milliseconds, a finite number >= 0"
            raise ValueError(f"{ENV}: {key}={value!r} must be {kind} (e.g. {ENV}={EXAMPLE!r})")
        faults[key] = number
    if ("slow_rank" in faults) != ("slow_rank_ms" in faults):
        raise ValueError(f"{ENV}: slow_rank and slow_rank_ms go together (e.g. slow_rank=1,slow_rank_ms=80)")
    if ("perturb_rank" in faults) != ("perturb_step" in faults):
        raise ValueError(f"{ENV}: perturb_rank and perturb_step go together (e.g. perturb_rank=1,perturb_step=4)")
    return faults


def injected_delays(rank: int, environ: Mapping[str, str] = os.environ) -> dict[str, float]:
    """Phase name -> seconds slept on entering it, on this rank, from $SCALETRAIN_FAULTS (empty when unset)."""
    faults = parse_faults(environ.get(ENV, ""))
    delays = {}
    if faults.get("data_delay_ms", 0) > 0:
        delays["data"] = faults["data_delay_ms"] / 1e3
    if faults.get("slow_rank") == rank and faults["slow_rank_ms"] > 0:
        # every forward pass (pipeline: every schedule step) of that rank, like a slower device
        delays["forward"] = delays["fb"] = faults["slow_rank_ms"] / 1e3
    return delays


def injected_perturbation(environ: Mapping[str, str] = os.environ) -> tuple[int, int] | None:
    """(rank, step) at which one replica's weights are perturbed, from $SCALETRAIN_FAULTS; None when unset."""
    faults = parse_faults(environ.get(ENV, ""))
    if "perturb_rank" not in faults:
        return None
    return int(faults["perturb_rank"]), int(faults["perturb_step"])


def injected_stop(environ: Mapping[str, str] = os.environ) -> int | None:
    """The step after which every rank stops as if preempted, from $SCALETRAIN_FAULTS; None when unset."""
    step = parse_faults(environ.get(ENV, "")).get("stop_step")
    return None if step is None else int(step)
