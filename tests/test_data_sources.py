"""Datasets at any size: Megatron .bin/.idx and prepared shards read back through memory maps, document-start
masking, mixing by weight with its exact-prefix guarantee, on-disk sample orders, prefetch, and resume across
world sizes in real processes."""

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import torchrun
from data_helpers import random_documents, write_megatron, write_prepared
from scaletrain.config import DataConfig
from scaletrain.config.schema import MixEntry
from scaletrain.data import DistributedLoader, TokenWindows, build_loaders, open_datasets
from scaletrain.data.megatron import open_megatron
from scaletrain.data.mix import MixSchedule
from scaletrain.data.sources import CACHE_NAME, cache_folder
from scaletrain.models.loss import IGNORE_INDEX

RUNNER = Path(__file__).resolve().parent / "data_runner.py"


def test_megatron_pair_written_from_the_spec_reads_back_the_same_tokens(tmp_path):
    # documents of one or several sequences (Megatron's sentence splitting), uint16 and int32 files
    docs = [[d] if i % 3 else [d[: len(d) // 2], d[len(d) // 2 :]] for i, d in enumerate(random_documents(40, 5000, 1))]
    for code, dtype in [(8, "<u2"), (4, "<i4")]:
        prefix = tmp_path / f"corpus_{code}"
        write_megatron(prefix, docs, code, dtype)
        index, stream = open_megatron(prefix, tmp_path / "cache")
        flat = [t for doc in docs for seq in doc for t in seq]
        assert stream.num_tokens == len(flat) and index.num_documents == len(docs)
        assert stream.read(0, len(flat)).tolist() == flat
        assert stream.read(17, 93).tolist() == flat[17:93]
        doc_starts = np.cumsum([0] + [sum(map(len, d)) for d in docs[:-1]])
        assert stream.document_starts(0, len(flat)).tolist() == doc_starts.tolist()
    # the same file by every spelling of data.path, recognised without data.source
    for spelling in ["corpus_8", "corpus_8.bin", "corpus_8.idx"]:
        (ds,) = open_datasets(DataConfig(path=str(tmp_path / spelling)), 5000, 0)
        assert ds.kind == "megatron" and ds.train.num_tokens + ds.val.num_tokens == len(flat)


def test_prepared_shards_pack_documents_and_mask_their_starts(tmp_path):
    docs = [[1 + (i * 7 + j) % 200 for j in range(n)] for i, n in enumerate([5, 12, 3, 30, 9, 4, 17, 8])]
    write_prepared(tmp_path / "ds", {"train": docs, "val": docs[:4]}, eos_id=0, docs_per_shard=3)
    (ds,) = open_datasets(DataConfig(path=str(tmp_path / "ds"), seq_len=10), 256, 0)
    assert ds.kind == "prepared" and ds.val.num_tokens == 54 and len(ds.train.segments) == 3
    flat = [t for d in docs for t in [*d, 0]]
    assert ds.train.read(0, len(flat)).tolist() == flat  # shards read as one stream, EOS after each document
    starts = set(np.cumsum([0] + [len(d) + 1 for d in docs[:-1]]).tolist())
    seq = 10
    plain, masked = TokenWindows(ds.train, seq), TokenWindows(ds.train, seq, mask_doc_starts=True)
    idx = np.arange(plain.num_samples)
    (x, y), (x2, y2) = plain.rows(idx), masked.rows(idx)
    assert (x == x2).all()
    for r, i in enumerate(idx):
        for j in range(seq):
            position = i * seq + 1 + j  # the token target j predicts
            want = IGNORE_INDEX if position in starts else flat[position]
            assert y2[r, j] == want and y[r, j] == flat[position]
    assert (y2 == IGNORE_INDEX).sum() >= 6  # windows do cross documents and shards


def test_mix_is_exact_on_every_prefix_and_within_one_percent_over_ten_thousand_samples():
    mix = MixSchedule([0.7, 0.3])
    which, local = mix.locate(np.arange(10_000))
    share = (which == 0).mean()
    assert abs(share - 0.7) <= 0.01 * 0.7
    n = np.arange(1, 10_001)
    for k, w in enumerate([0.7, 0.3]):
        prefix = np.cumsum(which == k)
        assert np.abs(prefix - n * w).max() <= 1  # the documented guarantee, on every prefix
        assert local[which == k].tolist() == list(range(int(prefix[-1])))  # each dataset read in its own order
    three = MixSchedule([5, 3, 2])  # weights need not sum to 1
    which, _ = three.locate(np.arange(10_000))
    for k, w in enumerate([0.5, 0.3, 0.2]):
        assert np.abs(np.cumsum(which == k) - n * w).max() <= 1
    with pytest.raises(ValueError, match="round them"):
        MixSchedule([1 / 997, 1 / 991, 1 - 1 / 997 - 1 / 991])
    with pytest.raises(ValueError, match="drop it"):
        MixSchedule([1.0, 0.0001])


def test_mixed_loader_resumes_at_another_world_size_with_cached_orders(tmp_path):
    a = write_prepared(tmp_path / "a", {"train": [list(range(100, 140))] * 20}, docs_per_shard=7)
    write_prepared(tmp_path / "b", {"train": [list(range(0, 50))] * 12}, docs_per_shard=5)
    assert a.splits["train"].num_tokens == 800  # no val split: the tail 5 % is held out, 760 tokens = 94 samples
    cfg = DataConfig(
        mix={"a": MixEntry(path=str(tmp_path / "a"), weight=0.7), "b": MixEntry(path=str(tmp_path / "b"), weight=0.3)},
        seq_len=8,
        prefetch=0,
    )

    def step_tokens(loaders):
        return [int(t) for ld in loaders for mb in ld.next_step() for t in mb.inputs[:, 0]]

    ref = build_loaders(cfg, 256, 5, 20, 20, 0, 1)[0]
    want = [step_tokens([ref]) for _ in range(12)]  # 240 samples: several epochs of both datasets
    from_a = sum(t >= 100 for step in want for t in step)
    assert from_a == 168  # 0.7 x 240 exactly: 240 is a whole number of periods
    two = [build_loaders(cfg.model_copy(update={"prefetch": 2}), 256, 5, 20, 5, r, 2)[0] for r in range(2)]
    got = [step_tokens(two) for _ in range(5)]
    four = [build_loaders(cfg, 256, 5, 20, 5, r, 4)[0] for r in range(4)]
    for ld in four:
        ld.load_state_dict(two[0].state_dict())
    got += [step_tokens(four) for _ in range(7)]
    assert got == want
    orders = sorted(p.name for p in (tmp_path / "a" / ".scaletrain-cache").glob("order-*.npy"))
    assert orders and all(p.startswith("order-n94-seed5-epoch") for p in orders)
    assert isinstance(ref._order(0, 0), np.memmap)  # mapped from the file, not held by the rank


def _same_step(a: list, b: list) -> bool:
    """Two loaders' steps hold the same micro-batches (as many of them, and not none)."""
    return len(a) == len(b) > 0 and all((p.inputs == q.inputs).all() for p, q in zip(a, b))


def test_prefetch_returns_the_same_steps_and_follows_a_resume():
    windows = TokenWindows(np.arange(5_001), 10)
    plain = DistributedLoader(windows, 8, 4, 1, 2, seed=2)
    ahead = DistributedLoader(windows, 8, 4, 1, 2, seed=2, prefetch=3)
    for _ in range(4):
        assert _same_step(plain.next_step(), ahead.next_step())
    plain.load_state_dict({"consumed_samples": 80, "seed": 2})
    ahead.load_state_dict({"consumed_samples": 80, "seed": 2})  # prefetched steps 5-7 are dropped
    for _ in range(2):
        assert _same_step(plain.next_step(), ahead.next_step())
    ahead.close()


def test_read_only_data_folder_caches_elsewhere(tmp_path, monkeypatch):
    """Data in a folder nobody may write into keeps its index arrays under XDG_CACHE_HOME. CI runs as root, whom a
    chmod-ed folder does not stop, so the unwritable folder is /proc/self, which root cannot write either; a
    writable folder keeps its cache beside the data, and data.cache_dir wins over both."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    in_proc = Path("/proc/self/status")  # cache_folder only reads where the file is, never the file
    with pytest.raises(OSError):  # the premise: not even root can create the cache folder there
        (in_proc.parent / CACHE_NAME).mkdir()
    assert cache_folder(in_proc, None).is_relative_to(tmp_path / "xdg" / "scaletrain" / "data")
    ds = tmp_path / "ds"
    write_prepared(ds, {"train": [list(range(50))] * 4})
    assert cache_folder(ds, None) == ds / CACHE_NAME
    assert cache_folder(ds, str(tmp_path / "c")).parent == tmp_path / "c"


def test_a_file_where_the_cache_folder_goes_is_not_taken_for_it(tmp_path, monkeypatch):
    """A file named .scaletrain-cache beside the data (root cannot write into it either): the loader caches in the
    home cache instead of a traceback on the first step, and leaves the file alone."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    ds = tmp_path / "ds"
    write_prepared(ds, {"train": [list(range(50))] * 40})
    (ds / CACHE_NAME).write_text("not a folder")
    assert cache_folder(ds, None).is_relative_to(tmp_path / "xdg" / "scaletrain" / "data")
    loader = build_loaders(DataConfig(path=str(ds), seq_len=8, prefetch=0), 256, 3, 4, 4, 0, 1)[0]
    assert len(loader.next_step()) == 1
    assert (ds / CACHE_NAME).read_text() == "not a folder"


def _launch(nproc: int, args: list[str], cwd: Path) -> None:
    torchrun(nproc, [str(RUNNER), *args], cwd=cwd, timeout=300)


def test_resume_from_two_to_four_real_ranks_sees_every_sample_once_per_epoch(tmp_path):
    data = tmp_path / "ds"
    write_prepared(data, {"train": [list(range(i, i + 100)) for i in range(0, 1000, 100)]}, vocab_size=65536)
    # 1,000 train tokens (50 held out for validation) -> 118 samples of 8; 10 steps of 16 cross an epoch boundary
    _launch(2, [str(data), str(tmp_path / "first.json"), "4"], tmp_path)
    first = json.loads((tmp_path / "first.json").read_text())
    (tmp_path / "state.json").write_text(json.dumps(first["state"]))
    _launch(4, [str(data), str(tmp_path / "second.json"), "6", str(tmp_path / "state.json")], tmp_path)
    second = json.loads((tmp_path / "second.json").read_text())
    seen = [s for step in first["steps"] + second["steps"] for s in step]
    ref = build_loaders(DataConfig(path=str(data), seq_len=8, prefetch=0), 256, 3, 16, 16, 0, 1)[0]
    assert seen == [int(t) // 8 for _ in range(10) for mb in ref.next_step() for t in mb.inputs[:, 0]]
    n = ref.windows.num_samples
    assert sorted(seen[:n]) == list(range(n))  # the first epoch: every sample exactly once
    assert len(set(seen[n:])) == len(seen) - n  # the second: no repeats so far
    assert second["state"]["consumed_samples"] == 160


@pytest.mark.slow  # 1- and 2-rank launches; layout parity is test_parity.py's, prepared data reading is tested above without launching
def test_layouts_keep_loss_parity_on_a_prepared_dataset(tmp_path):
    from scaletrain.data.sources import stdlib_documents
    from test_parallel_layouts import TOL, launch_runner, runner_losses

    text, starts = stdlib_documents(300_000)
    docs = [list(text[a:b]) for a, b in zip([0, *starts], [*starts, len(text)])]
    write_prepared(tmp_path / "ds", {"train": docs[:-3], "val": docs[-3:]}, docs_per_shard=20)
    data = [f"data.path={tmp_path / 'ds'}", "data.mask_doc_starts=true"]
    launch_runner(1, {"single": data}, tmp_path / "one")
    jobs = {"fsdp": data, "ddp": [*data, "parallel.dp_replicate=2"], "accum": [*data, "train.micro_batch_size=2"]}
    launch_runner(2, jobs, tmp_path / "two")
    ref = runner_losses(tmp_path / "one" / "single")
    assert len(ref) == 10 and ref[-1] < ref[0]
    for name in jobs:
        got = runner_losses(tmp_path / "two" / name)
        assert len(got) == len(ref), (name, ref, got)
        assert max(abs(a - b) for a, b in zip(ref, got)) <= TOL, (name, ref, got)
