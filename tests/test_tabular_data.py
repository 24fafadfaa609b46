"""`scaletrain data prepare --format tabular` (click logs for DLRM-style recommenders) and its loader: Parquet, CSV,
JSON Lines and Criteo's headerless TSV give the arrays their rows say (log1p on dense, missing values, ids a stable
hash of the value's text), the same in one chunk or many; the loader's stream is deterministic, sees every row once
per epoch and resumes at another data-parallel degree with exactly the rows an unbroken run sees; bad input is one
line and exit 2 with nothing written. The data is generated here."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_cli_in_process
from scaletrain.data.tabular import row_hash_unit

MASK64 = (1 << 64) - 1
ROWS = 240


def reference_id(value: object) -> int:
    """The documented hash, one value at a time: fmix64(FNV-1a 64 of the UTF-8 text) >> 1; missing is 0."""
    if value is None:
        return 0
    h = 0xCBF29CE484222325
    for byte in str(value).encode():
        h = ((h ^ byte) * 0x100000001B3) & MASK64
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & MASK64
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & MASK64
    h ^= h >> 33
    return h >> 1


def make_rows(n: int = ROWS, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        rows.append({
            "label": int(rng.integers(0, 2)),
            "price": None if i % 7 == 3 else float(rng.normal(5, 10)),  # negatives too: log1p clips them at 0
            "age": None if i % 11 == 5 else int(rng.integers(0, 90)),
            "user": None if i % 13 == 2 else f"u{int(rng.integers(0, 40))}",
            "item": int(rng.integers(0, 1000)),
            "unused": "x",
        })  # fmt: skip
    return rows


def write_inputs(folder: Path, rows: list[dict]) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, folder / "clicks.parquet", row_group_size=50)
    text = lambda v: "" if v is None else repr(v) if isinstance(v, float) else str(v)
    lines = [",".join(rows[0])] + [",".join(text(v) for v in r.values()) for r in rows]
    (folder / "clicks.csv").write_text("\n".join(lines) + "\n")
    (folder / "clicks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {kind: folder / f"clicks.{kind}" for kind in ("parquet", "csv", "jsonl")}


def expected(rows: list[dict], val_share: float, transform: str = "log1p") -> dict[str, tuple]:
    """(dense, sparse, labels) per split, computed row by row from the input."""
    is_val = row_hash_unit(np.arange(len(rows))) < val_share
    out = {}
    for split, pick in (("train", ~is_val), ("val", is_val)):
        chosen = [r for r, v in zip(rows, pick) if v]
        raw = np.array([[r["price"] or 0.0, r["age"] or 0.0] for r in chosen], dtype=np.float64).reshape(-1, 2)
        dense = (np.log1p(np.maximum(raw, 0)) if transform == "log1p" else raw).astype(np.float32)
        sparse = np.array([[reference_id(r["user"]), reference_id(r["item"])] for r in chosen], dtype=np.int64)
        out[split] = (dense, sparse.reshape(-1, 2), np.array([r["label"] for r in chosen], dtype=np.float32))
    return out


def arrays(folder: Path, split: str) -> tuple[np.ndarray, ...]:
    return tuple(np.load(folder / split / f"{name}.npy", mmap_mode="r") for name in ("dense", "sparse", "labels"))


def prepare(cwd: Path, inputs: list[Path], out: Path, *extra: str, check: bool = True):
    args = ["data", "prepare", *map(str, inputs), "--out", str(out), "--format", "tabular", *extra]
    return run_cli_in_process(args, cwd, check=check)


COLS = ["--dense-cols", "price,age", "--sparse-cols", "user,item"]


def test_parquet_csv_and_jsonl_give_the_arrays_their_rows_say(tmp_path):
    rows = make_rows()
    inputs = write_inputs(tmp_path / "in", rows)
    want = expected(rows, 0.2)
    for kind, path in inputs.items():
        out = tmp_path / kind
        proc = prepare(tmp_path, [path], out, *COLS, "--val-share", "0.2")
        assert proc.stdout.startswith(f"{out}: 2 dense, 2 sparse columns; train ")
        for split in ("train", "val"):
            got = arrays(out, split)
            for name, a, b in zip(("dense", "sparse", "labels"), got, want[split]):
                assert a.dtype == b.dtype and a.shape == b.shape, (kind, split, name)
                np.testing.assert_allclose(a, b, rtol=1e-6, err_msg=f"{kind} {split} {name}")
            assert (got[1] == want[split][1]).all()  # ids exactly
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["format"] == "tabular" and manifest["dense"] == ["price", "age"]
        assert manifest["sparse"] == ["user", "item"] and manifest["label"] == "label"
        train, val = manifest["splits"]["train"], manifest["splits"]["val"]
        assert train["samples"] + val["samples"] == ROWS and 0.1 * ROWS < val["samples"] < 0.3 * ROWS
        assert train["positives"] == int(want["train"][2].sum()) and val["positives"] == int(want["val"][2].sum())
        assert manifest["sparse_ids"]["user"] == {"distinct": len(set(want["train"][1][:, 0])), "capped": False}
        assert manifest["sources"] == [{"path": str(path), "format": kind, "rows": ROWS}]


def criteo_line(rng: np.random.Generator, label: int) -> str:
    dense = ["" if rng.random() < 0.2 else str(int(rng.integers(-3, 500))) for _ in range(13)]
    sparse = ["" if rng.random() < 0.2 else f"{int(rng.integers(0, 2**32)):08x}" for _ in range(26)]
    return "\t".join([str(label), *dense, *sparse])


@pytest.fixture(scope="module")
def criteo(tmp_path_factory) -> tuple[Path, list[list[str]]]:
    """A prepared Criteo-style folder (two day files, one gzipped) and the input's fields."""
    tmp = tmp_path_factory.mktemp("criteo")
    rng = np.random.default_rng(1)
    lines = [criteo_line(rng, int(rng.integers(0, 2))) for _ in range(300)]
    (tmp / "day_0").write_text("\n".join(lines[:180]) + "\n")
    with gzip.open(tmp / "day_1.gz", "wt") as f:
        f.write("\n".join(lines[180:]) + "\n")
    prepare(tmp, [tmp / "day_0", tmp / "day_1.gz"], tmp / "data", "--val-share", "0.1")
    return tmp, [line.split("\t") for line in lines]


def test_criteo_tsv_layout_hash_stable_and_streamed_in_chunks_equal_to_one(criteo):
    from scaletrain.data.tabular_prepare import TabularPrepareOptions, prepare_tabular

    tmp, fields = criteo
    manifest = json.loads((tmp / "data/manifest.json").read_text())
    assert manifest["dense"] == [f"I{i}" for i in range(1, 14)] and manifest["sparse"][-1] == "C26"
    assert [s["rows"] for s in manifest["sources"]] == [180, 120]
    is_val = row_hash_unit(np.arange(300)) < 0.1
    train = [f for f, v in zip(fields, is_val) if not v]
    dense, sparse, labels = arrays(tmp / "data", "train")
    raw = np.array([[float(x) if x else 0.0 for x in f[1:14]] for f in train])
    np.testing.assert_array_equal(dense, np.log1p(np.maximum(raw, 0)).astype(np.float32))
    assert sparse.tolist() == [[reference_id(x or None) for x in f[14:]] for f in train]
    assert labels.tolist() == [float(f[0]) for f in train]

    # a second prepare (another chunk size, another process's view of the same files) writes the same bytes
    again = prepare_tabular([tmp / "day_0", tmp / "day_1.gz"], tmp / "chunked",
                            TabularPrepareOptions(val_share=0.1, rows_per_chunk=7))  # fmt: skip
    assert again.splits == manifest["splits"]
    for split in ("train", "val"):
        for name in ("dense.npy", "sparse.npy", "labels.npy"):
            assert (tmp / "chunked" / split / name).read_bytes() == (tmp / "data" / split / name).read_bytes()

    raw_kept = prepare_tabular([tmp / "day_0"], tmp / "raw", TabularPrepareOptions(val_share=0.0,
                                                                                   dense_transform="none"))  # fmt: skip
    assert raw_kept.splits["val"]["samples"] == 0
    first = np.array([[float(x) if x else 0.0 for x in f[1:14]] for f in fields[:180]], dtype=np.float32)
    np.testing.assert_array_equal(arrays(tmp / "raw", "train")[0], first)

    shown = run_cli_in_process(["data", "inspect", str(tmp / "data")], tmp).stdout
    assert "dense (13, float32, log1p): I1, I2" in shown and f"train: {len(train)} rows, " in shown
    assert "distinct ids in train: C1 " in shown and f"sample (train row 0): label {train[0][0]}" in shown


def steps(loader, count: int) -> list[list]:
    return [loader.next_step() for _ in range(count)]


def rows_of(batches: list) -> torch.Tensor:
    """A step's rows as (ids..., label) to compare by value."""
    return torch.cat([torch.cat([b.sparse.float(), b.labels[:, None]], 1) for b in batches])


def test_loader_deterministic_each_row_once_per_epoch_and_resumes_at_another_dp_degree(criteo):
    from scaletrain.data.tabular_loader import TabularLoader

    folder = criteo[0] / "data"
    dense, sparse, labels = arrays(folder, "train")
    n = len(labels)
    one = TabularLoader(folder, "train", global_batch=8, micro_batch=4, dp_rank=0, dp_size=1, seed=3)
    assert one.accumulation_steps == 2 and one.trained_only is False
    ids = one.sample_ids(0, 3 * n)
    for epoch in range(3):  # every row once per epoch, a new order each epoch
        assert sorted(ids[epoch * n : (epoch + 1) * n].tolist()) == list(range(n))
    assert ids[:n].tolist() != ids[n : 2 * n].tolist()
    assert list((folder / ".scaletrain-cache").glob(f"order-n{n}-seed3-epoch*.npy"))

    unbroken = steps(one, 40)  # 320 samples: more than one epoch
    first = unbroken[0][0]
    assert first.dense.dtype == torch.float32 and first.sparse.dtype == torch.int64 and first.dense.shape == (4, 13)
    want = ids[:4]
    assert torch.equal(first.dense, torch.from_numpy(dense[want]))
    assert torch.equal(first.sparse, torch.from_numpy(sparse[want])) and first.labels.tolist() == labels[want].tolist()
    ahead = TabularLoader(folder, "train", 8, 4, 0, 1, seed=3, prefetch=2)
    assert all(torch.equal(rows_of(a), rows_of(b)) for a, b in zip(steps(ahead, 40), unbroken))
    ahead.close()

    # 15 steps on two ranks, then the rest on one: the same samples, in the same order
    ranks = [TabularLoader(folder, "train", 8, 2, r, 2, seed=3) for r in range(2)]
    broken = [torch.cat([rows_of(r.next_step()) for r in ranks]) for _ in range(15)]
    state = ranks[0].state_dict()
    resumed = TabularLoader(folder, "train", 8, 4, 0, 1, seed=0)
    resumed.load_state_dict(state)
    broken += [rows_of(resumed.next_step()) for _ in range(25)]
    assert all(torch.equal(a, rows_of(b)) for a, b in zip(broken, unbroken))

    val = TabularLoader(folder, "val", 4, 2, 0, 1, seed=3, shuffle=False)
    assert val.sample_ids(0, 4).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="^global batch 8 is not a multiple of micro batch 3 x data-parallel "):
        TabularLoader(folder, "train", 8, 3, 0, 1, seed=3)


def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path):
    rows = make_rows(30)
    inputs = write_inputs(tmp_path / "in", rows)
    csv = inputs["csv"]
    bad_label = tmp_path / "in/bad_label.csv"
    lines = csv.read_text().splitlines()
    lines[5] = "2" + lines[5][1:]
    bad_label.write_text("\n".join(lines) + "\n")
    words = tmp_path / "in/words.csv"
    words.write_text("label,price,user\n1,2.5,a\nyes,1,b\n")
    text_price = tmp_path / "in/text_price.csv"
    text_price.write_text("label,price,user\n1,2.5,a\n0,cheap,b\n")
    header_only = tmp_path / "in/empty.csv"
    header_only.write_text("label,price,user\n")
    narrow_tsv = tmp_path / "in/narrow.tsv"
    narrow_tsv.write_text("1\t2\tab\n")
    cases = {
        (str(tmp_path / "in/nope.csv"), *COLS): f"{tmp_path / 'in/nope.csv'}: no such file; give existing Parquet, "
        "CSV, JSON Lines or Criteo TSV files",
        (str(csv), "--dense-cols", "price,colour", "--sparse-cols", "user"): f"--dense-cols: {csv} has no column "
        "'colour' (its columns: label, price, age, user, item, unused); name columns it has",
        (str(bad_label), *COLS): f"{bad_label} row 5: label '2' is not 0 or 1; fix the row, or name the label column "
        "with --label-col (now 'label')",
        (str(words), "--dense-cols", "price", "--sparse-cols", "user"): f"{words} row 2: label 'yes' is not 0 or 1",
        (str(text_price), "--dense-cols", "price", "--sparse-cols", "user"): f"{text_price}: dense column 'price' "
        "holds a value that is not a number",
        (str(header_only), "--dense-cols", "price", "--sparse-cols", "user"): f"{header_only}: no rows; give files "
        "with data",
        (str(csv), "--dense-cols", "price,age", "--sparse-cols", "age"): "--dense-cols/--sparse-cols: 'age' is in "
        "both; a column is either dense (numbers) or sparse (categories), name it in one",
        (str(csv),): f"--dense-cols/--sparse-cols: {csv} is not a headerless Criteo TSV, so name its feature columns",
        (str(narrow_tsv),): f"{narrow_tsv}: a headerless TSV of 3 columns, not Criteo's 40",
        (str(csv), *COLS, "--tokenizer", "bytes"): "--tokenizer: does not apply to --format tabular; drop it",
        (str(csv), *COLS, "--val-share", "1.5"): "--val-share: 1.5 is not in [0, 1)",
    }
    out = tmp_path / "new" / "deeper" / "out"  # the folders a failed prepare made are gone too
    for args, message in cases.items():
        proc = prepare(tmp_path, list(map(Path, args[:1])), out, *args[1:], check=False)
        assert proc.returncode == 2, (args, proc.stdout)
        assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith(f"scaletrain: error: {message}")
        assert not (tmp_path / "new").exists() and not proc.stdout
    text = ["data", "prepare", str(csv), "--out", str(out), "--tokenizer", "bytes", "--label-col", "y"]
    proc = run_cli_in_process(text, tmp_path, check=False)
    assert proc.returncode == 2 and proc.stderr == ("scaletrain: error: --label-col: applies to --format tabular; "
                                                    "drop it, or pass --format tabular\n")  # fmt: skip

    prepare(tmp_path, [csv], out, *COLS)
    again = prepare(tmp_path, [csv], out, *COLS, check=False)
    assert again.returncode == 2 and again.stderr == (f"scaletrain: error: --out: {out} already holds a tabular "
                                                      f"dataset; pass --overwrite to replace it, or choose another "
                                                      f"folder\n")  # fmt: skip
    prepare(tmp_path, [csv], out, "--dense-cols", "price", "--sparse-cols", "user", "--overwrite")
    assert json.loads((out / "manifest.json").read_text())["dense"] == ["price"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]  # no temporary folder left beside it
