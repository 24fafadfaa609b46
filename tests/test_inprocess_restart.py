"""In-process restart (launch.restart=in-process): a rank SIGKILLed mid-run, then the other rank frozen by SIGSTOP,
are each replaced by a warm spare while the surviving rank keeps its process (same PID, no re-import), and the run
ends with every step's loss and the final weights bit-identical to an unkilled run's; a layout it cannot serve is
refused in one line before launch."""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import losses, run_cli
from test_checkpoint_memory import _snapshot_step, assert_same_final_weights, start_slow_train
from test_checkpoint_memory import wait_while_running
from scaletrain.config import ConfigError, load_config
from scaletrain.train.inprocess import frozen_ranks, warm_up
from scaletrain.train.watchdog import Watchdog, read_heartbeats

STEPS = 14  # room for a kill, a recovery, a freeze and a second recovery
VICTIM = 0  # rank 0 writes the metrics and commits the checkpoints: the harder rank to lose
JOB = [
    f"train.steps={STEPS}",
    "monitor.log_interval=1",
    "train.global_batch_size=8",
    "data.seq_len=32",
    "train.eval_batches=1",
    "train.eval_interval=0",
    "data.max_bytes=100000",
    "train.warmup_steps=2",
    "monitor.progress=false",
    "monitor.tensorboard=false",
    "monitor.sample_interval_s=0",
    "checkpoint.interval_steps=0",  # no disk checkpoint before the end: the restart resumes from host memory
    "checkpoint.memory_interval_steps=2",
    "checkpoint.save_final=true",
    "launch.restart=in-process",
]


def _pids(run: Path, rank: int) -> list[int]:
    """The PID of each generation this rank ran in, from its rank log's section headers."""
    text = (run / "logs" / f"rank{rank}.log").read_text()
    return [int(p) for p in re.findall(rf"--- scaletrain rank {rank}, attempt \d+, pid (\d+)", text)]


def test_in_process_restart_refuses_several_nodes_in_one_line():
    with pytest.raises(ConfigError, match="launch.restart") as e:
        load_config(None, ["launch.restart=in-process", "launch.nnodes=2", "launch.rdzv_endpoint=10.0.0.1:29500"])
    assert "\n" not in str(e.value)


def test_launcher_judges_frozen_only_a_live_training_record_of_this_generation_and_process(tmp_path):
    with Watchdog(tmp_path, 0, 2, 300.0, 600.0) as dog:
        dog.beat(3, "forward/backward")
        (beat,) = read_heartbeats(tmp_path)
    assert beat["watching"] and beat["pid"] == os.getpid()
    (after,) = read_heartbeats(tmp_path)
    assert after["watching"] is False  # left the loop (building, saving, done): its silence is no freeze

    now, pid = beat["time"] + 6.0, os.getpid()
    assert frozen_ranks([beat], {0: pid}, 0, now, 5.0) == [(0, 6.0)]
    assert frozen_ranks([beat], {0: pid}, 0, beat["time"] + 4.0, 5.0) == []  # not silent long enough
    assert frozen_ranks([after], {0: pid}, 0, now, 5.0) == []
    assert frozen_ranks([beat], {0: pid}, 1, now, 5.0) == []  # a record of an earlier generation
    assert frozen_ranks([beat], {0: pid + 1}, 0, now, 5.0) == []  # another process held the rank then
    assert frozen_ranks([beat], {1: pid}, 0, now, 5.0) == []  # rank 0 is done or dead: not judged


WARM_UPS = """
import json, sys
import torch
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from scaletrain.config import load_config
from scaletrain.train.inprocess import forget_mesh_caches, warm_up

computed = [0]
real = ShardingPropagator.propagate_op_sharding_non_cached
def counted(self, *args, **kwargs):
    computed[0] += 1
    return real(self, *args, **kwargs)
ShardingPropagator.propagate_op_sharding_non_cached = counted
cfg = load_config(None, sys.argv[1:])
rng = torch.get_rng_state()
out = []
for rank, forget in ((1, False), (1, False), (0, True)):
    if forget:
        forget_mesh_caches()
    computed[0] = 0
    out.append([warm_up(cfg, 2, rank), computed[0], torch.equal(torch.get_rng_state(), rng)])
print(json.dumps(out))
"""


def test_spare_warm_up_computes_what_a_replacement_would_compute_first_and_leaves_no_trace(tmp_path, monkeypatch):
    import json
    import sys

    import torch.distributed as dist

    # a fresh interpreter: the DTensor sharding rules the 2-rank FSDP step needs are computed by the first warm-up
    # (as rank 1); the second (as the replacement's first real step would) finds them all cached; a spare that
    # takes rank 0 forgets the rank-1 mesh's entries, and computes them again
    args = [*JOB, "model.name=tiny", "model.n_layers=1", "run.name=warm"]
    got = subprocess.run(
        [sys.executable, "-c", WARM_UPS, *args], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert got.returncode == 0, got.stderr[-3000:]
    (first, rules, kept), (second, again, _), (third, after_forget, _) = json.loads(got.stdout.splitlines()[-1])
    assert first == second == third == "" and kept
    assert rules > 20 and again == 0 and after_forget == rules, (rules, again, after_forget)
    assert not (tmp_path / "runs").exists()  # nothing written into the run folder
    monkeypatch.setattr("scaletrain.parallel.runtime.pick_device_type", lambda device: "cuda")
    assert "cuda job" in warm_up(load_config(None, args), 2, 1) and not dist.is_initialized()


def test_launcher_gives_a_dead_rank_the_spare_that_warmed_up_as_it():
    from types import SimpleNamespace

    from scaletrain.launch.inprocess import _Group, _Worker

    group = _Group(None, 4, "127.0.0.1", 0, None)  # type: ignore[arg-type]
    alive = SimpleNamespace(is_alive=lambda: True, pid=1)
    dead = SimpleNamespace(is_alive=lambda: False, pid=2)
    assert group.next_warm_rank() == 3 and group.spare_for(0) is None
    group.workers = [
        _Worker(0, alive, rank=0),  # type: ignore[arg-type]
        _Worker(1, alive, warm_rank=3),  # type: ignore[arg-type]
        _Worker(2, dead, warm_rank=2),  # type: ignore[arg-type]  a spare that died covers nothing
        _Worker(3, alive, orders=1, warm_rank=1),  # type: ignore[arg-type]  ordered once: a rank now, or stopped
        _Worker(4, alive, warm_rank=1),  # type: ignore[arg-type]
    ]
    assert [w.slot for w in group.spares()] == [1, 4]
    assert group.spare_for(1).slot == 4 and group.spare_for(3).slot == 1
    assert group.spare_for(0).slot == 1  # none warmed up as rank 0: the first spare (it forgets its mesh caches)
    assert group.next_warm_rank() == 2


@pytest.mark.slow  # an unkilled launch, and one launch whose rank 0 is killed, then rank 1 frozen, each replaced
def test_sigkilled_then_sigstopped_rank_is_replaced_in_process_survivors_keep_pids_and_losses_match(tmp_path):
    run_cli(["train", *JOB, "run.name=clean", "launch.spares=0"], tmp_path)  # no spare importing beside it
    ref = tmp_path / "runs" / "clean"

    run = tmp_path / "runs" / "killed"
    proc = start_slow_train(tmp_path, [*JOB, "run.name=killed", "launch.max_restarts=2"])
    deadline = time.monotonic() + 300
    wait_while_running(proc, lambda: _snapshot_step(run) >= 4, deadline)  # a few steps in, a snapshot to resume from
    victim, survivor = _pids(run, VICTIM)[0], _pids(run, 1 - VICTIM)[0]
    os.kill(victim, signal.SIGKILL)
    newest = _snapshot_step(run)  # no snapshot commits without the killed rank

    # generation 1 trains (a snapshot newer than the one it resumed from): freeze the rank that survived the kill;
    # its collective peer cannot tell, only the launcher's heartbeat check can
    wait_while_running(proc, lambda: len(_pids(run, VICTIM)) >= 2 and _snapshot_step(run) > newest, deadline)
    os.kill(survivor, signal.SIGSTOP)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]

    # each survivor ran its generations in one process; a warm spare (another PID) took each lost rank
    victim_pids, frozen_pids = _pids(run, VICTIM), _pids(run, 1 - VICTIM)
    assert len(victim_pids) == 3 and victim_pids[0] == victim and victim_pids[1] == victim_pids[2] != victim
    assert len(frozen_pids) == 3 and frozen_pids[:2] == [survivor, survivor] and frozen_pids[2] != survivor
    assert f"spare pid {victim_pids[1]} takes rank {VICTIM}" in err, err[-3000:]
    assert f"at step {newest} (saved by" in err, err[-3000:]  # resumed from the snapshot: no step lost
    assert f"rank {1 - VICTIM} (pid {survivor}) stopped reporting" in err, err[-3000:]
    assert f"spare pid {frozen_pids[2]} takes rank {1 - VICTIM}" in err, err[-3000:]

    assert_same_final_weights(run, ref, STEPS)
    assert losses(run) == losses(ref)


@pytest.mark.slow  # one launch, its launcher SIGKILLed a few steps in
def test_ranks_and_spares_end_with_a_sigkilled_launcher(tmp_path):
    """The ranks and spares run in process groups of their own (the launcher kills what a dead rank leaves in its
    group), out of reach of a signal to the launcher's group: a SIGKILL of the launcher must still end them (they
    lose its store, which holds their orders and keys), not leave them training into the run folder."""
    import psutil

    run = tmp_path / "runs" / "orphans"
    proc = start_slow_train(tmp_path, [*JOB, "run.name=orphans", "launch.spares=1"], stdout=subprocess.DEVNULL)
    # training, with its checkpoint writer threads busy
    wait_while_running(proc, lambda: _snapshot_step(run) >= 2, time.monotonic() + 300)
    family = psutil.Process(proc.pid).children(recursive=True)
    assert len(family) >= 3, family  # two ranks and a spare
    proc.kill()
    proc.communicate()
    _, alive = psutil.wait_procs(family, timeout=60)
    for p in alive:
        p.kill()
    assert not alive, [p.pid for p in alive]
