"""Fault injection for testing the diagnosis (monitor.fault_* options): sleeps added inside timed phases, so a
test can make the data source or one rank slow on purpose. Off by default; never set them in a real run."""

from __future__ import annotations


def injected_delays(cfg, rank: int) -> dict[str, float]:
    """Phase name -> seconds slept on entering it, on this rank."""
    delays = {}
    if cfg.fault_data_delay_ms > 0:
        delays["data"] = cfg.fault_data_delay_ms / 1e3
    if cfg.fault_slow_rank == rank and cfg.fault_slow_rank_ms > 0:
        # every forward pass (pipeline: every schedule step) of that rank, like a slower device
        delays["forward"] = delays["fb"] = cfg.fault_slow_rank_ms / 1e3
    return delays
