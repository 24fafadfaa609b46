"""`scaletrain data prepare` / `inspect`: the tokens on disk are the documents tokenized directly (+EOS), the same
bytes for any --workers, a killed prepare resumes to the same shards without rewriting finished ones, and bad input
is one line, exit 2, nothing written."""

from __future__ import annotations

import gzip
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from scaletrain.cli.main import main
from scaletrain.data.manifest import read_manifest, sha256_file, verify_shards
from scaletrain.data.prepare import PrepareOptions, held_out, prepare

EOS = "<|endoftext|>"
WORDS = "the quick brown fox jumps over a lazy dog while élan naïve 日本語 data tokens shard".split()


def _doc(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))) + rng.choice(["", ".", "\n"])


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer (vocabulary 400) trained here, saved as a Hugging Face tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(1)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([_doc(rng) for _ in range(300)], trainer)
    folder = tmp_path_factory.mktemp("tok")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return folder


def _corpus(root: Path, fifo: bool = False) -> list[str]:
    """A folder mixing .txt, .jsonl, .jsonl.gz and .parquet; returns its documents in the documented read order
    (a folder's files by name, then its subfolders). With fifo=True the last text file is a named pipe, so a
    prepare blocks there until the test writes it."""
    rng = random.Random(0)
    docs: list[str] = []
    root.mkdir(parents=True)
    for i in range(3):
        text = _doc(rng)
        (root / f"a{i}.txt").write_text(text)
        docs.append(text)
    rows = [_doc(rng) for _ in range(40)] + [""]  # an empty document is dropped
    lines = [json.dumps({"id": i, "text": t}) for i, t in enumerate(rows)]
    (root / "b.jsonl").write_text("\n".join(lines[:20]) + "\n\n" + "\n".join(lines[20:]) + "\n")
    docs += rows
    rows = [_doc(rng) for _ in range(25)]
    pq.write_table(pa.table({"text": rows, "n": list(range(25))}), root / "c.parquet", row_group_size=7)
    docs += rows
    sub = root / "sub"
    sub.mkdir()
    rows = [_doc(rng) for _ in range(30)]
    with gzip.open(sub / "d.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in rows)
    docs += rows
    last = root / "zz" / "z.txt"
    last.parent.mkdir()
    text = _doc(rng) * 3
    if fifo:
        os.mkfifo(last)
    else:
        last.write_text(text)
    return [*docs, text]


def _read_split(folder: Path, split: str, dtype: str) -> list[list[int]]:
    docs = []
    for s in read_manifest(folder).splits[split].shards:
        tokens = np.fromfile(folder / s.tokens, dtype=dtype)
        ends = np.fromfile(folder / s.docs, dtype="<i8")
        docs += [tokens[a:b].tolist() for a, b in zip([0, *ends[:-1]], ends)]
    return docs


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_mixed_folder_tokens_equal_direct_tokenization_same_bytes_for_any_worker_count(tmp_path, tokenizer_dir):
    from tokenizers import Tokenizer

    docs = _corpus(tmp_path / "corpus")
    opts = dict(inputs=[str(tmp_path / "corpus")], tokenizer=str(tokenizer_dir), val_share=0.2, shard_tokens=300)
    one = prepare(PrepareOptions(out=tmp_path / "w1", workers=1, piece_bytes=400, **opts))
    prepare(PrepareOptions(out=tmp_path / "w4", workers=4, piece_bytes=400, **opts))
    prepare(PrepareOptions(out=tmp_path / "whole", workers=2, **opts))  # default pieces: one a file

    m = one.manifest
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    assert (m.dtype, m.tokenizer.eos_id, m.tokenizer.kind) == ("uint16", eos, "huggingface")
    assert m.tokenizer.vocab_size == tok.get_vocab_size(with_added_tokens=True)
    expected = [tok.encode(d, add_special_tokens=False).ids + [eos] for d in docs if d]
    train, val = _read_split(tmp_path / "w1", "train", m.dtype), _read_split(tmp_path / "w1", "val", m.dtype)
    is_val = held_out(np.arange(len(expected)), 0.2)
    assert 0 < len(val) < len(expected) // 2 and len(train) + len(val) == len(expected)
    train_it, val_it = iter(train), iter(val)
    assert [next(val_it) if v else next(train_it) for v in is_val] == expected
    assert m.splits["train"].num_documents == len(train) and m.source["documents_skipped_empty"] == 1
    assert m.splits["train"].num_tokens == sum(map(len, train))
    shards = m.splits["train"].shards
    assert len(shards) > 3 and all(s.num_tokens >= 300 for s in shards[:-1])  # closed at 300 tokens, whole docs
    verify_shards(tmp_path / "w1", m)

    # 1 and 4 workers, pieces of 400 bytes: every file identical, the manifest included
    assert _files(tmp_path / "w1") == _files(tmp_path / "w4")
    # cut into other pieces: the same shards (only the arguments' digest in the manifest differs)
    whole = _files(tmp_path / "whole")
    assert {k: v for k, v in whole.items() if k != "manifest.json"} == {
        k: v for k, v in _files(tmp_path / "w1").items() if k != "manifest.json"
    }
    assert read_manifest(tmp_path / "whole").splits == m.splits

    # the same command again: nothing to do, nothing rewritten
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "w1").rglob("*")}
    again = prepare(PrepareOptions(out=tmp_path / "w1", workers=1, piece_bytes=400, **opts))
    assert again.already_done and before == {p: p.stat().st_mtime_ns for p in (tmp_path / "w1").rglob("*")}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "scaletrain.cli.main", "data", *args]


def test_killed_prepare_resumes_to_the_same_shards_without_rewriting_finished_ones(tmp_path, tokenizer_dir):
    """The corpus's last file is a named pipe: the prepare blocks there with everything before it written, and is
    killed (SIGKILL, whole process group). The rerun gets the pipe's text and must finish to the same shards as an
    uninterrupted prepare of the same documents, leaving the shards finished before the kill untouched."""
    docs = _corpus(tmp_path / "corpus", fifo=True)
    _corpus(tmp_path / "plain")
    out = tmp_path / "out"
    args = _cli("prepare", str(tmp_path / "corpus"), "--out", str(out), "--tokenizer", str(tokenizer_dir))
    args += ["--workers", "2", "--shard-tokens", "200", "--val-share", "0.1"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    first = subprocess.Popen(args, env=env, start_new_session=True, stderr=subprocess.PIPE, text=True)
    state = out / ".prepare-state" / "state.json"
    deadline = time.monotonic() + 120
    while not (state.is_file() and json.loads(state.read_text())["splits"]["train"]["shards"]):
        assert first.poll() is None, first.communicate()[1]
        assert time.monotonic() < deadline, "prepare wrote no checkpoint"
        time.sleep(0.2)
    time.sleep(1.0)  # let it reach the pipe; wherever it is killed, the rerun must give the same shards
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    assert not (out / "manifest.json").exists()  # an interrupted prepare never looks complete
    finished = json.loads(state.read_text())["splits"]["train"]["shards"]
    stamps = {s["tokens"]: (out / s["tokens"]).stat().st_mtime_ns for s in finished}

    writer = threading.Thread(target=lambda: Path(tmp_path / "corpus/zz/z.txt").write_text(docs[-1]), daemon=True)
    writer.start()
    second = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert "resumed at piece" in second.stdout
    assert {name: (out / name).stat().st_mtime_ns for name in stamps} == stamps  # not written again

    reference = prepare(
        PrepareOptions(
            inputs=[str(tmp_path / "plain")],
            out=tmp_path / "ref",
            tokenizer=str(tokenizer_dir),
            workers=1,
            val_share=0.1,
            shard_tokens=200,
        )
    )
    got = read_manifest(out)
    assert got.splits == reference.manifest.splits  # same shards, sizes and sha256s
    assert {k: v for k, v in _files(out).items() if k != "manifest.json"} == {
        k: v for k, v in _files(tmp_path / "ref").items() if k != "manifest.json"
    }
    assert not (out / ".prepare-state").exists()


def _write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def _jsonl(*records) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


# (files to create, extra CLI args, the start of the one-line message); INPUT is tmp/in unless args name one.
# Mid-file faults come after good lines and are read by worker processes (--workers 2), after shards were begun.
BAD = {
    "missing input": ({}, ["nosuch.jsonl"], "nosuch.jsonl: no such file or folder"),
    "bad JSON on line 3": (
        {"in/0.txt": "first", "in/a.jsonl": _jsonl({"text": "a"}, {"text": "b"}, '{"text": "c"')},
        [],
        "line 3: bad JSON",
    ),
    "missing text key on line 2": (
        {"in/0.txt": "first", "in/a.jsonl": _jsonl({"text": "a"}, {"body": "b"})},
        [],
        "line 2: no 'text' key",
    ),
    "wrong --text-key": ({"in/a.jsonl": _jsonl({"text": "a"})}, ["--text-key", "body"], "line 1: no 'body' key"),
    "text not a string": ({"in/a.jsonl": _jsonl({"text": "a"}, {"text": 5})}, [], "line 2: 'text' is int"),
    "not UTF-8": ({"in/a.txt": b"ok", "in/b.txt": b"\xff\xfe bad"}, [], "b.txt: not UTF-8 text (byte 0)"),
    "empty dataset": ({"in/a.txt": "", "in/b.jsonl": _jsonl({"text": ""}, "")}, [], "no documents with text"),
    "empty folder": ({"in/.hidden": "x"}, [], "an empty folder"),
    "unknown tokenizer": ({"in/a.txt": "x"}, ["--tokenizer", "no/such/tok"], "--tokenizer no/such/tok: no such"),
    "val share": ({"in/a.txt": "x"}, ["--val-share", "0.9"], "--val-share: must be between 0 and 0.5"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, monkeypatch, name):
    files, args, message = BAD[name]
    monkeypatch.chdir(tmp_path)
    for rel, content in files.items():
        _write(tmp_path / rel, content)
    inputs = [] if args and not args[0].startswith("--") else ["in"]
    if "--tokenizer" not in args:
        args = [*args, "--tokenizer", "bytes"]
    result = CliRunner().invoke(
        main, ["data", "prepare", *inputs, *args, "--out", "out", "--workers", "2", "--shard-tokens", "1"]
    )
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scaletrain: error: ") and message in lines[0], result.stderr
    assert not (tmp_path / "out").exists()


def test_parquet_and_saved_dataset_inputs_and_tokenizer_problems(tmp_path, tokenizer_dir):
    runner = CliRunner()
    pq.write_table(pa.table({"body": ["x", None]}), _write(tmp_path / "p/a.parquet", b""))
    r = runner.invoke(
        main, ["data", "prepare", str(tmp_path / "p"), "--out", str(tmp_path / "o"), "--tokenizer", "bytes"]
    )
    assert r.exit_code == 2 and "a.parquet: no column 'text' (columns: body)" in r.stderr
    r = runner.invoke(
        main,
        [
            "data",
            "prepare",
            str(tmp_path / "p"),
            "--out",
            str(tmp_path / "o"),
            "--tokenizer",
            "bytes",
            "--text-key",
            "body",
        ],
    )
    assert r.exit_code == 2 and "row index 1 (from 0): 'body' is null" in r.stderr and not (tmp_path / "o").exists()

    # a tokenizer.json alone with no EOS special token: refused with --eos, fine with --no-eos
    from tokenizers import Tokenizer, models, pre_tokenizers

    bare = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    bare.pre_tokenizer = pre_tokenizers.Whitespace()
    bare.save(str(tmp_path / "bare.json"))
    _write(tmp_path / "t/a.txt", "a b a")
    base = [
        "data",
        "prepare",
        str(tmp_path / "t"),
        "--out",
        str(tmp_path / "o"),
        "--tokenizer",
        str(tmp_path / "bare.json"),
    ]
    r = runner.invoke(main, base)
    assert r.exit_code == 2 and "no EOS token found" in r.stderr and "--no-eos" in r.stderr
    r = runner.invoke(main, [*base, "--no-eos"])
    assert r.exit_code == 0, r.stderr
    assert _read_split(tmp_path / "o", "train", "uint16") == [[0, 1, 0]]

    # a Hugging Face datasets folder (save_to_disk) read through pyarrow; the bytes tokenizer, EOS 256
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["hé", "yo"]})}).save_to_disk(tmp_path / "hf")
    r = runner.invoke(
        main,
        [
            "data",
            "prepare",
            str(tmp_path / "hf"),
            "--out",
            str(tmp_path / "b"),
            "--tokenizer",
            "bytes",
            "--val-share",
            "0",
        ],
    )
    assert r.exit_code == 0, r.stderr
    m = read_manifest(tmp_path / "b")
    assert (m.tokenizer.vocab_size, m.tokenizer.eos_id, m.dtype) == (257, 256, "uint16")
    assert _read_split(tmp_path / "b", "train", "uint16") == [[104, 195, 169, 256], [121, 111, 256]]


def test_output_folder_refusals_overwrite_and_inspect(tmp_path, tokenizer_dir):
    runner = CliRunner()
    _write(tmp_path / "in/a.txt", "hello there, general data")
    _write(tmp_path / "in/b.jsonl", _jsonl({"text": "second doc"}))
    out = tmp_path / "out"
    prep = ["data", "prepare", str(tmp_path / "in"), "--out", str(out), "--val-share", "0"]
    assert runner.invoke(main, [*prep, "--tokenizer", str(tokenizer_dir)]).exit_code == 0
    done = _files(out)

    def refused(args: list[str], message: str) -> None:
        r = runner.invoke(main, args)
        assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr

    refused([*prep, "--tokenizer", "bytes"], "already holds a dataset prepared with different arguments")
    assert _files(out) == done
    refused(
        ["data", "prepare", str(tmp_path / "in"), "--out", str(tmp_path / "in" / "o"), "--tokenizer", "bytes"],
        "inside the input folder",
    )
    _write(tmp_path / "other/notes.md", "mine")
    refused(
        ["data", "prepare", str(tmp_path / "in"), "--out", str(tmp_path / "other"), "--tokenizer", "bytes"],
        "not empty and not a scaletrain dataset",
    )
    _write(tmp_path / "unfinished/.prepare-state/args.json", json.dumps({"sha256": "0" * 64}))
    refused(
        ["data", "prepare", str(tmp_path / "in"), "--out", str(tmp_path / "unfinished"), "--tokenizer", "bytes"],
        "unfinished prepare made with different arguments",
    )

    r = runner.invoke(main, ["data", "inspect", str(out), "--verify"])
    assert r.exit_code == 0, r.stderr
    assert "train: 2 documents" in r.output and "sha256 verified" in r.output
    assert 'decoded: "hello there, general data<|endoftext|>"' in r.output

    r = runner.invoke(main, [*prep, "--tokenizer", "bytes", "--overwrite"])
    assert r.exit_code == 0, r.stderr
    assert read_manifest(out).tokenizer.kind == "bytes"
    shard = out / read_manifest(out).splits["train"].shards[0].tokens
    assert sha256_file(shard) == read_manifest(out).splits["train"].shards[0].sha256_tokens
    shard.write_bytes(b"\x00\x00" + shard.read_bytes()[2:])
    r = runner.invoke(main, ["data", "inspect", str(out), "--verify"])
    assert r.exit_code == 1 and f"{shard}: checksum does not match" in r.stderr
    refused(["data", "inspect", str(tmp_path / "in")], "no manifest.json; not a prepared dataset")
