"""Checkpoint trust in one process (no ranks started): a save never skips an existing step folder, a checkpoint
that fails verification is set aside, nothing in a checkpoint runs code when read, and a signed manifest
(SCALETRAIN_CHECKPOINT_KEY) refuses a folder rewritten without the key."""

import json
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch

from scaletrain.checkpoint import CheckpointManager, verify
from scaletrain.checkpoint.manifest import KEY_ENV, set_aside_dirs, sha256_file
from scaletrain.checkpoint.safe_load import UnsafeCheckpoint, check_metadata, load_dcp
from scaletrain.config.schema import CheckpointConfig

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _model(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


def _manager(root: Path) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(async_save=False, keep=0), root, 0, 1, {"layout": "none"})


def _save(root: Path, step: int, seed: int):
    model, opt = _model(seed)
    _manager(root).save(step, model, opt, {"loader": {}})
    return model


def _rewrite_file(ckpt: Path, name: str, data: bytes) -> None:
    """Replace a file and its manifest entry, as someone who can write the folder could."""
    (ckpt / name).write_bytes(data)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": len(data), "sha256": sha256_file(ckpt / name)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_save_replaces_an_earlier_runs_folder_and_resume_sets_a_bad_one_aside(tmp_path):
    first = _save(tmp_path, 5, seed=0)
    second = _save(tmp_path, 5, seed=1)  # a new run (another manager) reaching the same step
    assert len(list(tmp_path.iterdir())) == 1  # replaced, no leftovers
    state = {"model": {k: torch.zeros_like(v) for k, v in second.state_dict().items()}}
    load_dcp(state, tmp_path / "step_00000005", no_dist=True)
    assert all(torch.equal(state["model"][k], v) for k, v in second.state_dict().items())
    assert not torch.equal(first[0].weight, second[0].weight)

    shard = next((tmp_path / "step_00000005").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0x01
    shard.write_bytes(bytes(data))
    assert _manager(tmp_path).latest_good() is None
    aside = set_aside_dirs(tmp_path)
    assert len(aside) == 1 and aside[0].name.startswith("step_00000005.corrupt-")
    _save(tmp_path, 5, seed=2)  # the same step can be saved again
    assert verify(tmp_path / "step_00000005").ok


def test_crafted_pickles_are_refused_without_running(tmp_path):
    _save(tmp_path, 1, seed=0)
    ckpt = tmp_path / "step_00000001"
    marker = tmp_path / "PWNED"
    meta = pickle.loads((ckpt / ".metadata").read_bytes())
    meta.planner_data = _Payload(marker)
    _rewrite_file(ckpt, ".metadata", pickle.dumps(meta))
    with pytest.raises(UnsafeCheckpoint, match="refuses to unpickle posix.system"):
        check_metadata(ckpt)
    verdict = verify(ckpt)
    assert not verdict.ok and "refuses to unpickle posix.system" in verdict.problem
    model, opt = _model(0)
    with pytest.raises(UnsafeCheckpoint):
        load_dcp({"model": model.state_dict()}, ckpt, no_dist=True)
    assert not marker.exists()


def test_non_tensor_values_are_read_as_plain_data_only(tmp_path):
    """DCP stores non-tensor values (optimizer hyper-parameters) as torch.save'd bytes and torch's default planner
    reads them with weights_only=False; ours refuses an object that is not plain data."""
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "PWNED"
    dcp.save({"x": torch.ones(2), "lr": 0.5}, checkpoint_id=str(tmp_path / "ok"), no_dist=True)
    state = {"x": torch.zeros(2), "lr": 0.0}
    load_dcp(state, tmp_path / "ok", no_dist=True)
    assert state["lr"] == 0.5 and torch.equal(state["x"], torch.ones(2))
    dcp.save({"x": torch.ones(2), "lr": _Payload(marker)}, checkpoint_id=str(tmp_path / "bad"), no_dist=True)
    assert not marker.exists()  # saving pickles the payload, it does not run it
    with pytest.raises(UnsafeCheckpoint, match="not plain data .*posix.system"):
        load_dcp({"x": torch.zeros(2), "lr": 0.0}, tmp_path / "bad", no_dist=True)
    assert not marker.exists()


def test_signed_manifest_refuses_a_folder_rewritten_without_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "s3cret")
    _save(tmp_path, 3, seed=0)
    ckpt = tmp_path / "step_00000003"
    assert "hmac" in json.loads((ckpt / "manifest.json").read_text())
    assert verify(ckpt).ok
    trainer = json.loads((ckpt / "trainer.json").read_text())
    _rewrite_file(ckpt, "trainer.json", json.dumps({**trainer, "step": 999}).encode())
    verdict = verify(ckpt)
    assert not verdict.ok and "signature does not match" in verdict.problem
    monkeypatch.setenv(KEY_ENV, "another")
    assert "signature does not match" in verify(ckpt).problem
    monkeypatch.delenv(KEY_ENV)
    assert verify(ckpt).ok  # without a key only the checksums speak, and the rewrite kept them consistent
    (ckpt / "extra.bin").write_bytes(b"x")
    assert "extra.bin is not in the manifest" in verify(ckpt).problem
