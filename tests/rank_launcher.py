"""`python tests/rank_launcher.py N SCRIPT ARGS...` (or `N -m MODULE ARGS...`): what `torchrun --nproc-per-node N
SCRIPT ARGS...` does for the
tests' runner scripts (torch's agent, a c10d rendezvous on a free port, the ranks' RANK/WORLD_SIZE/MASTER_* set), with
the ranks forked from one server process that imported torch, scaletrain and the script's own imports once
(scaletrain.launch.local.forked_ranks) instead of N interpreters importing them: an 8-rank launch on 2 cores saves
~25 s of CPU. The script runs in each rank as `python SCRIPT ARGS...` would run it (`__name__ == "__main__"`), a
module as `python -m MODULE ARGS...`."""

from __future__ import annotations

import runpy
import sys
import uuid
from pathlib import Path


def run_script(path: str, args: list[str], module: bool) -> None:
    sys.argv = [path, *args]
    try:
        if module:
            runpy.run_module(path, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:  # sys.exit(0) ends a rank well; anything else fails it as the interpreter would
        if e.code not in (None, 0):
            raise


def main() -> None:
    nproc, module = int(sys.argv[1]), sys.argv[2] == "-m"
    target, args = sys.argv[3 if module else 2], sys.argv[4 if module else 3 :]
    if not module:
        target = str(Path(target).resolve())
        sys.path.insert(0, str(Path(target).parent))  # as `python SCRIPT` puts its folder first
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from scaletrain.launch.local import RANK_IMPORTS, forked_ranks

    # a script also as a module: the server imports what it imports (its body runs only as __main__, in the ranks)
    script_imports = [] if module else [Path(target).stem]
    with forked_ranks(*RANK_IMPORTS, *script_imports) as start_method:
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc,
            run_id=f"tests-{uuid.uuid4().hex[:8]}",
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",
            monitor_interval=0.2,
            start_method=start_method,
        )
        elastic_launch(config, run_script)(target, args, module)


if __name__ == "__main__":
    main()
