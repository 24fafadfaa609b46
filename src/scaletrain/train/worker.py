"""What each rank runs. Started by `scaletrain train` through the torchrun agent, or directly by an external
launcher: `torchrun --nproc-per-node 2 -m scaletrain.train.worker [CONFIG.toml] [key=value ...]`.
"""

from __future__ import annotations

import os
import sys

from scaletrain.config import JobConfig, load_config, split_config_args, validate_config
from scaletrain.exit_codes import EXIT_BAD_INPUT
from scaletrain.monitor.rank_logs import log_exception, redirect_to_rank_log
from scaletrain.parallel.runtime import shutdown_distributed
from scaletrain.train.fingerprint import NodeMismatchError


def run_from_dict(tree: dict) -> dict:
    """Entry point for the torchrun agent (picklable: a plain dict of the resolved config). Everything the rank
    writes goes to RUN_DIR/logs/rank<r>.log; rank 0's progress still reaches the terminal."""
    cfg = validate_config(tree)
    rank = int(os.environ.get("RANK", "0"))
    console = redirect_to_rank_log(cfg.run_dir(), rank)
    failed_alone = False  # an error of this rank, which the others may not share (they wait in a collective)
    try:
        return _train()(cfg, console=console)
    except NodeMismatchError as e:
        # the user's mistake, not a crash: one line that the command prints as its error, and exit 2
        sys.stderr.write(f"[rank{rank}] {e}\n")
        sys.stderr.flush()
        raise SystemExit(EXIT_BAD_INPUT) from None
    except BaseException as e:
        if not isinstance(e, SystemExit):  # SystemExit(EXIT_REQUEUE) is a preemption, already logged
            log_exception(rank, e)
            failed_alone = True
        raise
    finally:
        shutdown_distributed(wait_for_peers=not failed_alone)


def _train():
    """The training loop, imported on a rank's first call: the launching command names run_from_dict without
    importing the trainer (a forked rank's server imported it already: launch/local.py RANK_IMPORTS)."""
    from scaletrain.train.loop import train

    return train


def run(cfg: JobConfig) -> None:
    """Train `cfg` as the rank an external launcher started (`scaletrain train` under torchrun, or main below)."""
    failed_alone = False
    try:
        _train()(cfg)
    except Exception:
        failed_alone = True  # no barrier the other ranks would never join (shutdown_distributed)
        raise
    finally:
        shutdown_distributed(wait_for_peers=not failed_alone)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    run(load_config(*split_config_args(argv)))


if __name__ == "__main__":
    main()
