"""Prepare throughput: `scaletrain data prepare` against Hugging Face `datasets` `map(batched=True, num_proc=N)`,
the same tokenizer on the same JSON Lines input, side by side.

    python benchmarks/data_prepare.py [--mb 30] [--workers 2] [--reps 2] [--markdown BENCHMARKS.md]

The script writes a JSON Lines corpus of --mb MB (documents of 50-500 words drawn from a Zipf-like vocabulary of
made-up words) and trains a byte-level BPE tokenizer (vocabulary 8,192) on its first 2 MB, all offline. Each rep
runs both sides, alternating, each in a fresh process timed from inside (imports excluded on both sides):

- scaletrain: `scaletrain.data.prepare.prepare()` with --workers processes: read the JSONL, tokenize, append EOS,
  hold out 1 % of documents, write uint16 shards and document ends, sha256 every file, write the manifest.
- datasets: `load_dataset("json")` (JSONL -> Arrow cache), then `Dataset.map(batched=True, num_proc=N)` calling the
  same `tokenizers.Tokenizer.encode_batch_fast` (+EOS), which writes its Arrow cache files; timed as load + map
  and as map alone.

Both sides must produce the same number of tokens. The table shows the median tokens/s over reps and the ratio
scaletrain / datasets (target >= 1.0).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ helpers import each other by name

EOS = "<|endoftext|>"
SECTION = "## Data prepare: tokens/s against datasets.map"


def write_corpus(path: Path, mb: float, seed: int = 0) -> int:
    """JSON Lines of made-up-word documents, at least `mb` MB; returns the number of documents."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(1, 10))) for _ in range(20000)]
    weights = [1.0 / (i + 1) for i in range(len(words))]
    target, size, n = int(mb * 1e6), 0, 0
    with open(path, "w") as f:
        while size < target:
            doc = " ".join(rng.choices(words, weights, k=rng.randint(50, 500)))
            line = json.dumps({"id": n, "text": doc}) + "\n"
            f.write(line)
            size += len(line)
            n += 1
    return n


def train_tokenizer(corpus: Path, folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sample = []
    with open(corpus) as f:
        for line in f:
            sample.append(json.loads(line)["text"])
            if sum(map(len, sample)) > 2e6:
                break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8192, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(sample, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))


def run_scaletrain(corpus: Path, tokenizer: Path, out: Path, workers: int) -> dict:
    from scaletrain.data.prepare import PrepareOptions, prepare

    t0 = time.perf_counter()
    result = prepare(PrepareOptions(inputs=[str(corpus)], out=out, tokenizer=str(tokenizer), workers=workers))
    seconds = time.perf_counter() - t0
    tokens = sum(s.num_tokens for s in result.manifest.splits.values())
    return {"seconds": seconds, "tokens": tokens}


def run_datasets(corpus: Path, tokenizer: Path, out: Path, workers: int) -> dict:
    import datasets
    import pyarrow.compute as pc
    from tokenizers import Tokenizer

    datasets.disable_progress_bars()
    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    eos = tok.token_to_id(EOS)

    def encode(batch):
        return {"input_ids": [e.ids + [eos] for e in tok.encode_batch_fast(batch["text"], add_special_tokens=False)]}

    t0 = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(out))
    t1 = time.perf_counter()
    mapped = ds.map(encode, batched=True, num_proc=workers, remove_columns=ds.column_names)
    t2 = time.perf_counter()
    tokens = int(pc.sum(pc.list_value_length(mapped.data.column("input_ids"))).as_py())
    return {"seconds": t2 - t0, "map_seconds": t2 - t1, "tokens": tokens}


def measure(side: str, corpus: Path, tokenizer: Path, out: Path, workers: int) -> dict:
    """One side in a fresh process (no tokenizer thread pool or page cache state shared with the other side's
    Python objects); returns its JSON line."""
    proc = subprocess.run(
        [sys.executable, __file__, "--run", side, str(corpus), str(tokenizer), str(out), str(workers)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{side} failed:\n{proc.stderr[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=30.0, help="size of the generated JSONL corpus (MB)")
    ap.add_argument("--workers", type=int, default=2, help="scaletrain --workers and datasets num_proc")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--markdown", type=Path, help=f"also write the table into this file's '{SECTION}' section")
    ap.add_argument("--run", nargs=5, metavar=("SIDE", "CORPUS", "TOKENIZER", "OUT", "WORKERS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.run:
        side, corpus, tokenizer, out, workers = a.run
        fn = run_scaletrain if side == "scaletrain" else run_datasets
        print(json.dumps(fn(Path(corpus), Path(tokenizer), Path(out), int(workers))))
        return

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = root / "corpus.jsonl"
        docs = write_corpus(corpus, a.mb)
        train_tokenizer(corpus, root / "tok")
        size_mb = corpus.stat().st_size / 1e6
        print(f"corpus: {size_mb:.1f} MB, {docs:,} documents; BPE vocabulary 8,192; {a.workers} workers", flush=True)
        runs: dict[str, list[dict]] = {"scaletrain": [], "datasets": []}
        for rep in range(a.reps):
            for side in ("scaletrain", "datasets") if rep % 2 == 0 else ("datasets", "scaletrain"):
                r = measure(side, corpus, root / "tok", root / f"out-{side}", a.workers)
                runs[side].append(r)
                print(
                    f"rep {rep} {side}: {r['tokens'] / r['seconds']:,.0f} tokens/s ({r['seconds']:.2f} s)", flush=True
                )
    tokens = {r["tokens"] for rs in runs.values() for r in rs}
    if len(tokens) != 1:
        raise SystemExit(f"the two sides produced different token counts: {sorted(tokens)}")
    n = tokens.pop()
    ours = statistics.median(n / r["seconds"] for r in runs["scaletrain"])
    theirs = statistics.median(n / r["seconds"] for r in runs["datasets"])
    theirs_map = statistics.median(n / r["map_seconds"] for r in runs["datasets"])
    report = [
        "| runner | what is timed | tokens/s (median) | scaletrain / it |",
        "|---|---|---:|---:|",
        f"| scaletrain `data prepare` | JSONL -> tokens -> shards + sha256 + manifest | {ours:,.0f} | 1.00 |",
        f"| datasets `load_dataset` + `map` | JSONL -> Arrow cache -> tokenized Arrow cache | {theirs:,.0f} | "
        f"{ours / theirs:.2f} |",
        f"| datasets `map` alone | Arrow -> tokenized Arrow cache | {theirs_map:,.0f} | {ours / theirs_map:.2f} |",
        "",
    ]
    print(f"\n{n:,} tokens from {size_mb:.1f} MB of JSONL, {a.workers} workers, {a.reps} reps\n")
    print("\n".join(report))
    if a.markdown:
        import sections
        from peers import machine

        sections.write_section(
            a.markdown,
            SECTION,
            "benchmarks/data_prepare.py",
            None,
            report,
            machine(),
            note=f"{size_mb:.1f} MB of generated JSONL ({docs:,} documents, {n:,} tokens), byte-level BPE of "
            f"8,192 tokens trained by the script, {a.workers} worker processes / num_proc, median of {a.reps} reps.",
        )


if __name__ == "__main__":
    main()
