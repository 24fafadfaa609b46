"""What each rank runs. Started by `scaletrain train` through the torchrun agent, or directly by an external
launcher: `torchrun --nproc-per-node 2 -m scaletrain.train.worker [CONFIG.toml] [key=value ...]`.
"""

from __future__ import annotations

import sys

from scaletrain.config import load_config, validate_config
from scaletrain.parallel.runtime import shutdown_distributed
from scaletrain.train.loop import train


def run_from_dict(tree: dict) -> dict:
    """Entry point for the torchrun agent (picklable: a plain dict of the resolved config)."""
    try:
        return train(validate_config(tree))
    finally:
        shutdown_distributed()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv and "=" not in argv[0] else None
    cfg = load_config(path, argv[1:] if path else argv)
    try:
        train(cfg)
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
