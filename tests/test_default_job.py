"""The main job exactly as a new user runs it: `scaletrain train` with no arguments."""

import json

import pytest

from conftest import losses, run_cli, val_losses


@pytest.mark.slow  # 300 steps on 2 ranks (~6 min on a loaded 2-core host); a CLI launch whose loss falls is
# test_parity.py's, and CI runs this job again on the minimum torch (tests/min_torch/run.sh)
def test_default_train_loss_falls_and_reports_validation(tmp_path):
    proc = run_cli(["train"], tmp_path, timeout=900)
    run = tmp_path / "runs" / "default"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["device"] == "cpu" and summary["steps"] == 300
    got = losses(run)
    assert got[0] > 4.0 and got[-1] < 2.5  # from ~ln(256) = 5.5 towards real structure of Python source
    assert len(val_losses(run)) >= 3 and val_losses(run)[-1] < 2.5
    assert "validation loss" in proc.stderr
    assert "rank1" not in proc.stderr  # other ranks' logs are off by default
