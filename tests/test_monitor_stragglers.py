"""Stragglers and silent errors: a rank consistently slower than the others is named (log, metrics, diagnosis), and
monitor.replica_check_interval names a data-parallel replica whose weights drifted. Rules in one process; one
launch of 3 CPU ranks (DDP) with a slowed and a perturbed rank checks both end to end."""

import json
import logging

import pytest
import torch

from conftest import run_cli
from scaletrain.monitor import read_jsonl
from scaletrain.monitor.diagnosis import diagnose
from scaletrain.monitor.faults import ENV as FAULTS
from scaletrain.monitor.faults import injected_perturbation
from scaletrain.monitor.replicas import judge, weight_fingerprint
from scaletrain.monitor.stragglers import StragglerWatch


def _window(step: int, busy: list[float]) -> dict:
    return {"step": step, "busy_s_per_rank": list(busy)}


def test_a_rank_slower_for_enough_steps_is_named_and_forgotten_when_it_recovers(caplog):
    caplog.set_level(logging.INFO, logger="scaletrain")
    watch = StragglerWatch(ratio=1.5, steps=20)
    records = []
    for step in range(10, 110, 10):  # windows of 10 steps; rank 2 is 1.6x from step 21 to 80
        slow = 21 <= step <= 80
        record = _window(step, [0.10, 0.11, 0.16 if slow else 0.10, 0.10])
        watch.observe(record, 10)
        records.append(record)
    named = {r["step"]: r.get("stragglers") for r in records}
    assert named[30] is None and named[40] == [2] and named[80] == [2] and named[90] is None, named
    assert records[3]["straggler_since_step"] == [21]
    assert "straggler: rank 2 has been 1.60x slower" in caplog.text and "for 20 steps, since step 21" in caplog.text
    assert "rank 2 is no longer slow at step 90" in caplog.text
    # 1.4x never counts at ratio 1.5, however long
    calm = StragglerWatch(ratio=1.5, steps=20)
    for step in range(10, 200, 10):
        record = _window(step, [0.10, 0.14])
        calm.observe(record, 10)
        assert "stragglers" not in record
    # the diagnosis names the persistent straggler even where the run's median spread would not flag it
    rows = [{**r, "time_data_s": 0.0, "step_time_s": 0.2, "comm_s_per_rank": [0.0] * 4} for r in records]
    finding = [f for f in diagnose(rows) if f.rule == "straggler"]
    assert finding and finding[0].ranks == [2] and "rank 2 1.60x the others at steps 21-80" in finding[0].evidence


def test_replica_check_groups_ranks_by_the_piece_they_hold_and_names_the_one_that_drifted():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    same = weight_fingerprint(model)
    assert weight_fingerprint(model) == same
    with torch.no_grad():
        model[0].weight.view(-1)[3] += 1e-3
    drifted = weight_fingerprint(model)
    assert drifted[0] == same[0] and drifted[1] != same[1]  # the same piece, other bits
    assert judge(5, [same, same, drifted, same]).diverging == [2]
    assert judge(5, [same, drifted]).diverging == [0, 1]  # two replicas: no majority, both named
    other_piece = ("another-shard", 7)
    verdict = judge(5, [same, other_piece, same, ("yet-another", 1)])
    assert verdict.diverging == [] and verdict.groups == 1
    assert injected_perturbation({FAULTS: "perturb_rank=1,perturb_step=4"}) == (1, 4)
    assert injected_perturbation({}) is None
    with pytest.raises(ValueError, match="go together"):
        injected_perturbation({FAULTS: "perturb_rank=1"})


@pytest.mark.slow  # one launch of 3 ranks
def test_slowed_rank_is_named_and_perturbed_replica_is_caught(tmp_path):
    proc = run_cli(
        [
            "train",
            "train.steps=8",
            "monitor.log_interval=2",
            "train.global_batch_size=12",
            "data.seq_len=32",
            "train.eval_batches=1",
            "train.eval_interval=0",
            "data.max_bytes=100000",
            "train.warmup_steps=2",
            "monitor.progress=false",
            "monitor.sample_interval_s=0",
            "monitor.tensorboard=false",
            "model.dim=64",
            "model.n_layers=1",
            "parallel.dp_replicate=3",
            "monitor.straggler_steps=4",
            "monitor.replica_check_interval=2",
            "run.name=faults",
            "--nproc-per-node",
            "3",
        ],
        tmp_path,
        env={FAULTS: "slow_rank=1,slow_rank_ms=150,perturb_rank=2,perturb_step=4"},
    )
    run = tmp_path / "runs" / "faults"
    records = read_jsonl(run / "metrics.jsonl")
    assert any(r.get("stragglers") == [1] for r in records), records
    checks = {r["step"]: r for r in records if "replica_check" in r}
    assert checks[2]["replica_check"] == "ok" and checks[2]["replica_groups"] == 1, checks
    assert checks[4]["diverging_ranks"] == [2] and checks[8]["diverging_ranks"] == [2], checks
    assert "straggler: rank 1 has been" in proc.stderr
    assert "replica check at step 4: rank(s) 2 hold weights" in proc.stderr
    found = {f["rule"]: f for f in json.loads((run / "monitor" / "diagnosis.json").read_text())}
    assert found["straggler"]["ranks"] == [1] and found["replica_divergence"]["ranks"] == [2], found
