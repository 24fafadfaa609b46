"""Signals and inherited state in the server that forks a host's ranks (launch/local.py forked_ranks:
multiprocessing's forkserver, which imports this module first, before torch).

The server lives beside the ranks: in the launch's process group and in its Slurm step, whose `srun` delivers a
signal to every process of the step. A SIGTERM, SIGUSR1 or SIGHUP meant for the job would end the server, and the
agent would then read every rank it forked as dead (multiprocessing reports exit 255 once the server is gone) instead
of letting them checkpoint and exit 75. So the server blocks those signals (they stay pending in it, unused; it ends
when the launching process closes its pipe), and each process it forks unblocks them at once (os.register_at_fork),
before any of its own code runs: a rank gets them as a spawned rank would, one sent meanwhile included.

A process forked here leaves the objects it inherits out of its garbage collections (gc.freeze), and asks this
server, not a new one, for the forkserver processes it starts itself (DCP's writer process,
checkpoint/async_writer.py): multiprocessing would otherwise start a server of its own in each rank, an interpreter
importing torch again.

Only the server acts on the import: the process whose parent set SERVER_OF to its own pid (forked_ranks, before it
starts the server); anywhere else the import does nothing."""

from __future__ import annotations

import gc
import os
import signal

SERVER_OF = "SCALETRAIN_RANK_SERVER_OF"  # the pid of the process that starts the server
HELD = frozenset({signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT})


def _in_child() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)
    # the ~320,000 objects of the server's imports (torch, the trainer) stay alive for the child's life: out of the
    # collector's sight, a full collection takes microseconds instead of ~0.25 s, and it no longer writes to (so
    # copies) every page the child shares with the server
    gc.freeze()
    from multiprocessing import forkserver, resource_tracker

    # the child knows this server's address (set by the server's main loop) and gets its client's liveness pipe
    # as it starts: only the start of another server, which it would do for want of a pid of its own, is skipped
    forkserver._forkserver.ensure_running = resource_tracker.ensure_running  # type: ignore[method-assign]


def hold_signals_if_server() -> bool:
    """Block HELD here and unblock them in every child forked from here, when this process is the rank server."""
    if os.environ.get(SERVER_OF) != str(os.getppid()):
        return False
    signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
    os.register_at_fork(after_in_child=_in_child)
    return True


hold_signals_if_server()
