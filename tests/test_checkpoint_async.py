"""Async checkpoints off the training step (checkpoint/async_writer.py), on 2 gloo ranks: the writer process starts
with the manager and stops with it, each checkpoint holds the weights of its own step although the next update ran
right after save() returned, and rank 0 committed every save in the background."""

import json

from conftest import torchrun

RUNNER = str(__import__("pathlib").Path(__file__).with_name("checkpoint_async_runner.py"))


def test_async_saves_hold_their_steps_weights_and_commit_in_the_background(tmp_path):
    out = tmp_path / "result.json"
    torchrun(2, [RUNNER, str(tmp_path / "ckpt"), str(out)], cwd=tmp_path)
    got = json.loads(out.read_text())
    assert got["matches"] == {"1": True, "2": True, "3": True}, got
    assert got["writer_started"] and got["writer_stopped"], got
    assert got["staging_wait_s"] > 0, got  # the update after each save waited for its staging copy (the pre-hook)
    assert got["committed"] == ["step_00000001", "step_00000002", "step_00000003"], got
