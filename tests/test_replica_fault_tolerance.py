"""Replica fault tolerance (launch.fault_tolerance=replicas): on 4 ranks, 2 replicas x FSDP 2, a rank of replica 1
is SIGKILLed; replica 0 trains on alone with the same global batch while a spare refills replica 1, which then
rejoins at a step boundary from the live state in host memory. Every step's loss, the final weights and the data
position equal those of a reference that ran the same replica counts per step (stopped and resumed in the other
layout through disk checkpoints); the surviving processes keep their PIDs. Configs it cannot serve are refused in
one line."""

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from conftest import losses, run_cli
from test_checkpoint_memory import _snapshot_step, assert_same_final_weights, start_slow_train, wait_while_running
from scaletrain.config import ConfigError, load_config
from scaletrain.config.layout import Layout
from scaletrain.exit_codes import EXIT_REQUEUE
from scaletrain.monitor import read_jsonl
from scaletrain.monitor.faults import ENV as FAULTS
from scaletrain.resolve import resolve_job

STEPS = 40  # the refilled replica (a spare, warming up beside the ranks) must be ready before the end
VICTIM = 2  # replica 1's first rank
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
    "checkpoint.interval_steps=0",
    "checkpoint.save_final=true",
    "run.name=run",
]
FT = [
    "launch.restart=in-process",
    "launch.fault_tolerance=replicas",
    "checkpoint.memory_interval_steps=1",
    "launch.max_restarts=1",
    "launch.spares=1",
]


def _pids(run: Path, rank: int) -> list[int]:
    text = (run / "logs" / f"rank{rank}.log").read_text()
    return [int(p) for p in re.findall(r"in-process restart: generation \d+, rank \d+, pid (\d+)", text)]


def test_replica_fault_tolerance_refuses_what_it_cannot_serve_in_one_line():
    for extra, field in (
        (["launch.fault_tolerance=replicas", "parallel.dp_replicate=2"], "launch.restart=in-process"),
        (["launch.fault_tolerance=replicas", "launch.restart=in-process"], "parallel.dp_replicate=2"),
        (
            ["launch.fault_tolerance=replicas", "launch.restart=in-process", "parallel.dp_replicate=2"],
            "checkpoint.memory_interval_steps",
        ),
    ):
        with pytest.raises(ConfigError, match="launch.fault_tolerance") as e:
            load_config(None, extra)
        assert field in str(e.value) and "\n" not in str(e.value)
    # 3 DDP replicas, 3 samples a step: on 2 replicas the global batch does not split
    cfg = load_config(None, [*FT, "parallel.dp_replicate=3", "train.global_batch_size=3", "model.name=tiny"])
    with pytest.raises(ValueError, match="on 2 of the 3 replicas the job does not resolve") as e:
        resolve_job(cfg, 3)
    assert "train.global_batch_size" in str(e.value) and "\n" not in str(e.value)
    assert resolve_job(
        cfg.with_replicas(3).model_copy(update={"train": cfg.train.model_copy(update={"global_batch_size": 6})}), 3
    )


def test_a_replica_is_the_same_positions_in_every_pipeline_stage():
    layout = Layout(dp_replicate=2, dp_shard=2, tp=2, pp=2)  # ranks: pp-major, then replicas, then dp_shard x tp
    assert layout.replica_ranks == 8
    seen = {}
    for rank in range(layout.world_size):
        replica, position = layout.replica_of(rank)
        assert layout.rank_of(replica, position) == rank
        seen.setdefault(replica, []).append(rank)
    assert seen == {0: [0, 1, 2, 3, 8, 9, 10, 11], 1: [4, 5, 6, 7, 12, 13, 14, 15]}


def test_a_snapshot_of_another_replica_count_loads_each_rank_from_its_position_in_the_first_replica(tmp_path):
    from scaletrain.checkpoint.manager import BY_REPLICA, SAME_RANKS, CheckpointManager
    from scaletrain.config.schema import CheckpointConfig

    def degrees(replicas: int, shard: int = 2) -> dict:
        return {"pp": 2, "dp_replicate": replicas, "dp_shard": shard, "cp": 1, "tp": 1, "ep": 1}

    def info(replicas: int, shard: int = 2) -> dict:
        return {
            "layout": f"r{replicas}s{shard}",
            "world_size": 2 * replicas * shard,
            "degrees": degrees(replicas, shard),
        }

    cfg = CheckpointConfig(async_save=False, keep=0, memory_interval_steps=1)
    # 2 pipeline stages x 2 replicas x dp_shard 2: rank 6 is stage 1, replica 1, shard 0
    ckpt = CheckpointManager(cfg, tmp_path, 6, 8, info(2))
    assert ckpt._snapshot_fits(info(2)) == SAME_RANKS and ckpt._snapshot_file(SAME_RANKS, 2) == "rank6.pt"
    assert ckpt._snapshot_fits(info(1)) == BY_REPLICA and ckpt._snapshot_fits(info(3)) == BY_REPLICA
    assert ckpt._snapshot_file(BY_REPLICA, 1) == "rank2.pt"  # the 1-replica run's stage 1, shard 0
    assert ckpt._snapshot_file(BY_REPLICA, 3) == "rank6.pt"  # 3 replicas: stage 1 starts at rank 6
    assert ckpt._snapshot_fits(info(2, shard=4)) == 0  # other shards: the disk checkpoints instead
    assert ckpt._snapshot_fits({"layout": "old", "world_size": 4}) == 0  # a snapshot without degrees


@pytest.mark.slow  # a 4-rank launch with a kill, and a 3-launch reference (4, 2, 4 ranks)
def test_a_replica_killed_the_other_trains_on_the_refilled_one_rejoins_and_losses_match(tmp_path):
    ft = tmp_path / "ft"
    ft.mkdir()
    # steps slowed by sleeps in the data fetch (the arithmetic is unchanged): the spare that refills replica 1 gets
    # the cores it needs to be ready well before the last step, on a loaded host too
    args = [*JOB, *FT, "parallel.dp_replicate=2", "launch.nproc_per_node=4"]
    proc = start_slow_train(ft, args, env={FAULTS: "data_delay_ms=200"})
    run = ft / "runs" / "run"
    deadline = time.monotonic() + 300
    wait_while_running(proc, lambda: _snapshot_step(run) >= 3, deadline)
    survivors = {r: _pids(run, r)[0] for r in (0, 1, 3)}
    os.kill(_pids(run, VICTIM)[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "replica(s) [1] lost a rank: 1 of 2 replicas train on" in err, err[-3000:]
    assert "replica(s) [1] rejoin" in err, err[-3000:]

    # the replica counts per step: 2, then 1 from the snapshot the survivors resumed from, then 2 again
    counts = [r["replicas"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    assert len(counts) == STEPS
    alone = counts.index(1)
    back = alone + counts[alone:].index(2)
    assert counts == [2] * alone + [1] * (back - alone) + [2] * (STEPS - back), counts
    # replica 0 and replica 1's surviving rank kept their processes; a spare took the killed rank
    for rank, pid in survivors.items():
        assert set(_pids(run, rank)) == {pid}, (rank, _pids(run, rank))
    assert len(_pids(run, 0)) == 3 and len(_pids(run, 3)) == 2  # generations 0-2; 0 and 2 (it waited in 1)
    assert _pids(run, VICTIM)[-1] != _pids(run, VICTIM)[0]

    # the reference: the same replica counts per step, the layout changed through disk checkpoints
    ref = tmp_path / "ref"
    ref.mkdir()
    for replicas, nproc, stop in ((2, 4, alone), (1, 2, back), (2, 4, None)):
        env = {"SCALETRAIN_FAULTS": f"stop_step={stop}"} if stop else None
        args = [*JOB, f"parallel.dp_replicate={replicas}", f"launch.nproc_per_node={nproc}"]
        proc_ref = run_cli(["train", *args], ref, check=False, env=env)
        assert proc_ref.returncode == (EXIT_REQUEUE if stop else 0), proc_ref.stderr[-3000:]
    want = ref / "runs" / "run"
    assert losses(run) == losses(want)
    assert_same_final_weights(run, want, STEPS)
    # no sample trained twice or skipped: the data position after the last step is the reference's
    position = [json.loads((r / "checkpoints" / f"step_{STEPS:08d}" / "trainer.json").read_text()) for r in (run, want)]
    assert position[0]["loader"] == position[1]["loader"]
