"""Bad datasets: one line naming the problem, exit 2, before any rank starts, nothing written where the command ran."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from data_helpers import random_documents, write_megatron, write_prepared
from scaletrain.cli.main import main

SMALL = ["data.seq_len=16", "train.global_batch_size=4"]


def _good(folder, **kw):
    return write_prepared(folder, {"train": random_documents(60, 200, 0), "val": random_documents(10, 200, 1)}, **kw)


def _too_big_vocab(d):
    _good(d / "ds", vocab_size=1000)
    return ["data.path=" + str(d / "ds")], "data.path: " + str(d / "ds") + " was tokenized with a vocabulary of 1000"


def _megatron_id(d):
    docs = random_documents(30, 200, 2)
    docs[7][3] = 4321
    write_megatron(d / "meg", [[x] for x in docs])
    return ["data.path=" + str(d / "meg")], "data.path: token id 4321 at position"


def _empty(d):
    write_prepared(d / "ds", {"train": [], "val": []})
    return ["data.path=" + str(d / "ds")], "data.path: " + str(d / "ds") + " holds no tokens"


def _short(d):
    write_prepared(d / "ds", {"train": random_documents(2, 200, 3), "val": random_documents(2, 200, 4)})
    start = f"data.path: {d / 'ds'} holds 175 tokens, too few"
    return ["data.path=" + str(d / "ds"), "train.global_batch_size=64"], start


def _checksum(d):
    _good(d / "ds")
    shard = d / "ds" / "train" / "shard-00001.tokens"
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))  # same size: only the checksum sees it
    return ["data.path=" + str(d / "ds")], "data.path: " + str(shard) + ": checksum does not match"


def _truncated(d):
    _good(d / "ds")
    shard = d / "ds" / "val" / "shard-00000.docs"
    shard.write_bytes(shard.read_bytes()[:-3])
    return ["data.path=" + str(d / "ds"), "data.checksums=sizes"], "data.path: " + str(shard) + ": "


def _newer(d):
    _good(d / "ds")
    m = json.loads((d / "ds" / "manifest.json").read_text())
    m["version"] = 99
    (d / "ds" / "manifest.json").write_text(json.dumps(m))
    return ["data.path=" + str(d / "ds")], "data.path: " + str(d / "ds" / "manifest.json") + ": written by a newer"


def _not_megatron(d):
    (d / "x.bin").write_bytes(b"\0" * 64)
    (d / "x.idx").write_bytes(b"NOTANIDX" * 8)
    return ["data.path=" + str(d / "x")], "data.path: " + str(d / "x.idx") + ": not a Megatron"


def _folder_without_manifest(d):
    (d / "plain").mkdir()
    return ["data.path=" + str(d / "plain")], "data.path: " + repr(str(d / "plain")) + " is a folder without"


def _mask_flat(d):
    np.arange(5000, dtype=np.uint16).__mod__(200).astype(np.uint16).tofile(d / "tok.bin")
    return ["data.path=" + str(d / "tok.bin"), "data.mask_doc_starts=true"], "data.mask_doc_starts: "


def _mix_missing(d):
    _good(d / "ds")
    mix = [f'data.mix.web={{path="{d / "ds"}",weight=0.7}}', f'data.mix.code={{path="{d / "nope"}",weight=0.3}}']
    return mix, "data.mix.code: "


def _mix_and_path(d):
    return ["data.path=x", "data.mix.a={path='y',weight=1.0}"], "data.mix: set either"


CASES = [
    _too_big_vocab,
    _megatron_id,
    _empty,
    _short,
    _checksum,
    _truncated,
    _newer,
    _not_megatron,
    _folder_without_manifest,
    _mask_flat,
    _mix_missing,
    _mix_and_path,
]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__.strip("_") for c in CASES])
def test_bad_dataset_is_one_line_exit_2_before_any_rank(tmp_path, monkeypatch, case):
    data = tmp_path / "data"
    data.mkdir()
    args, start = case(data)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    result = CliRunner().invoke(main, ["train", *SMALL, *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("scaletrain: error: " + start), lines[0]
    assert list(work.iterdir()) == []


def test_checksums_are_verified_once_per_manifest(tmp_path, monkeypatch):
    from scaletrain.config import DataConfig
    from scaletrain.data.checks import check_data

    _good(tmp_path / "ds")
    cfg = DataConfig(path=str(tmp_path / "ds"), seq_len=16)
    check_data(cfg, 256, 4)
    assert list((tmp_path / "ds" / ".scaletrain-cache").glob("verified-*"))
    shard = tmp_path / "ds" / "train" / "shard-00000.tokens"
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    check_data(cfg, 256, 4)  # first_use: verified already, sizes still match
    with pytest.raises(ValueError, match="checksum does not match"):
        check_data(cfg.model_copy(update={"checksums": "always"}), 256, 4)
