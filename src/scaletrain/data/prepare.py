"""`scaletrain data prepare`: a corpus and a tokenizer -> token shards, document ends and a manifest (data/manifest.py).

Worker processes read and tokenize pieces of the inputs (data/readers.py) in parallel; the main process takes their
results back in input order and appends whole documents to the open shard of their split, closing a shard once it
holds `shard_tokens` tokens or more. The output depends only on the inputs' documents in order, the tokenizer and
the options, never on `workers`.

A document goes to the validation split when a hash of its index (0, 1, 2, ... over the kept documents) falls
below `val_share`: whole documents, spread over the corpus, the same choice on every run.

Restartable and atomic: shards are written as `.partial` files and renamed when closed; `DIR/.prepare-state/`
records the arguments' digest, the closed shards, the open shards' lengths and the next piece to read, rewritten
atomically after every piece that closed a shard (and every few seconds). A rerun with the same arguments truncates
the open shards to the recorded lengths and goes on from that piece; closed shards are not written again.
`manifest.json` is written last: a folder without it is not a dataset.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from scaletrain.data.manifest import (
    DOCS_DTYPE,
    MANIFEST,
    SPLITS,
    VERSION,
    DatasetError,
    DatasetManifest,
    Shard,
    Split,
    read_manifest,
    token_dtype,
    write_manifest,
)
from scaletrain.data.readers import (
    PIECE_BYTES,
    InputError,
    InputFile,
    Piece,
    check_text_key,
    find_inputs,
    pieces,
    read_documents,
)
from scaletrain.data.tokenizer import DocumentTokenizer, TokenizerError, load_tokenizer, token_array

PREPARE_VERSION = 1  # bump when the same arguments would give different shards (e.g. a new validation hash)
STATE_DIR = ".prepare-state"
DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB per uint16 shard: few files, each memory-mapped cheaply
ENCODE_BATCH = 1024  # documents per encode_batch call
CHECKPOINT_EVERY_S = 5.0


class PrepareError(ValueError):
    """Bad input to prepare; the message is one line naming what is wrong and how to fix it."""


@dataclass
class PrepareOptions:
    inputs: list[str]
    out: Path
    tokenizer: str  # "bytes" or a path
    text_key: str = "text"
    workers: int = 1
    eos: bool = True
    val_share: float = 0.01
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    overwrite: bool = False
    piece_bytes: int = PIECE_BYTES


@dataclass
class PrepareResult:
    manifest: DatasetManifest
    already_done: bool = False  # a finished dataset with the same arguments was there: nothing was done
    resumed_from_piece: int = 0  # > 0: an unfinished prepare was continued from this piece
    seconds: float = 0.0
    tokens_this_run: int = 0


# progress callback: (input bytes done, input bytes in all, tokens written by this run)
OnProgress = Callable[[int, int, int], None]


def prepare(opts: PrepareOptions, on_progress: OnProgress | None = None) -> PrepareResult:
    """Prepare a dataset in opts.out. Raises PrepareError (one line) for bad input; nothing is left half-written
    then. Any other interruption leaves a resumable state that the same call finishes."""
    start = time.perf_counter()
    if opts.shard_tokens < 1:
        raise PrepareError(f"--shard-tokens: must be >= 1 (got {opts.shard_tokens})")
    if not 0.0 <= opts.val_share <= 0.5:
        raise PrepareError(f"--val-share: must be between 0 and 0.5 (got {opts.val_share})")
    try:
        tok = load_tokenizer(opts.tokenizer, opts.eos)
        dtype = token_dtype(tok.info.vocab_size)
        files = find_inputs(opts.inputs, exclude=opts.out)
        for f in files:
            check_text_key(f, opts.text_key)
    except (TokenizerError, InputError, DatasetError) as e:
        raise PrepareError(str(e)) from None
    args = _arguments(opts, tok, files)
    digest = hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()

    out = opts.out
    status = _claim(out, digest, opts.overwrite)
    if status == "done":
        shutil.rmtree(out / STATE_DIR, ignore_errors=True)  # left by a kill after the manifest was written
        return PrepareResult(read_manifest(out), already_done=True, seconds=time.perf_counter() - start)
    created = not out.exists()
    state_dir = out / STATE_DIR
    if status == "new":
        state_dir.mkdir(parents=True, exist_ok=True)
        _write_json(state_dir / "args.json", {"sha256": digest, **args})
    state = _read_state(state_dir, digest)
    try:
        run = _Run(opts, tok, dtype, files, state, on_progress)
        run.go()
        train = run.splits["train"]
        if train.num_documents == 0:
            raise InputError(
                f"no documents with text in {len(files)} input file(s)"
                + (f" ({run.documents} went to validation; lower --val-share)" if run.documents else "")
                + "; check the inputs and --text-key"
            )
    except InputError as e:
        _remove_outputs(out, created)
        raise PrepareError(str(e)) from None
    manifest = DatasetManifest(
        dtype=dtype.name,
        tokenizer=tok.info,
        splits=run.splits,
        source={
            "inputs": [str(Path(i).resolve()) for i in opts.inputs],
            "files": len(files),
            "text_key": opts.text_key,
            "eos": opts.eos,
            "val_share": opts.val_share,
            "shard_tokens": opts.shard_tokens,
            "documents_skipped_empty": run.skipped,
            "args_sha256": digest,
        },
        created_by=f"scaletrain {_version()} data prepare",
    )
    write_manifest(out, manifest)
    shutil.rmtree(state_dir, ignore_errors=True)
    return PrepareResult(
        manifest,
        resumed_from_piece=state["next_piece"],
        seconds=time.perf_counter() - start,
        tokens_this_run=run.tokens_this_run,
    )


def _version() -> str:
    from scaletrain import __version__

    return __version__


def _arguments(opts: PrepareOptions, tok: DocumentTokenizer, files: list[InputFile]) -> dict:
    """Everything the shards depend on (inputs by path, size and mtime), for the same-arguments check."""
    return {
        "prepare_version": PREPARE_VERSION,
        "format_version": VERSION,
        "inputs": [[f.path, f.kind, f.gz, f.size, f.mtime_ns] for f in files],
        "tokenizer": tok.info.fingerprint,
        "vocab_size": tok.info.vocab_size,
        "eos_id": tok.info.eos_id,
        "text_key": opts.text_key,
        "val_share": opts.val_share,
        "shard_tokens": opts.shard_tokens,
        "piece_bytes": opts.piece_bytes,  # the resume point is a piece index
    }


def _claim(out: Path, digest: str, overwrite: bool) -> str:
    """What to do with the output folder: "done", "resume" or "new" (after clearing it when --overwrite says so).
    Refuses, before anything is written, a folder holding something else."""
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out {out}: a file, not a folder; choose a new or empty folder")
    if (out / MANIFEST).is_file():
        try:
            same = read_manifest(out).source.get("args_sha256") == digest
        except DatasetError:
            same = False
        if same and not overwrite:
            return "done"
        if not overwrite:
            raise PrepareError(
                f"--out {out}: already holds a dataset prepared with different arguments (inputs, tokenizer or "
                "options); pass --overwrite to replace it, or choose another folder"
            )
        _remove_outputs(out, created=False)
        return "new"
    args = out / STATE_DIR / "args.json"
    if args.is_file():
        try:
            same = json.loads(args.read_text()).get("sha256") == digest
        except (OSError, ValueError, AttributeError):
            same = False
        if same and not overwrite:
            return "resume"
        if not overwrite:
            raise PrepareError(
                f"--out {out}: holds an unfinished prepare made with different arguments; rerun that command to "
                "finish it, pass --overwrite to start over, or choose another folder"
            )
        _remove_outputs(out, created=False)
        return "new"
    if out.is_dir() and any(out.iterdir()):
        raise PrepareError(f"--out {out}: not empty and not a scaletrain dataset; choose a new or empty folder")
    return "new"


def _remove_outputs(out: Path, created: bool) -> None:
    """Remove what prepare writes (the manifest first, so the folder never looks complete), and the folder itself
    when this run made it."""
    (out / MANIFEST).unlink(missing_ok=True)
    for name in (*SPLITS, STATE_DIR):
        shutil.rmtree(out / name, ignore_errors=True)
    if created:
        shutil.rmtree(out, ignore_errors=True)


def _write_json(path: Path, obj: dict) -> None:
    """Atomically: a temporary file, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_state(state_dir: Path, digest: str) -> dict:
    path = state_dir / "state.json"
    fresh = {"args": digest, "next_piece": 0, "documents": 0, "skipped": 0, "splits": {}}
    if not path.is_file():
        return fresh
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return fresh
    return state if isinstance(state, dict) and state.get("args") == digest else fresh


def held_out(indices: np.ndarray, val_share: float) -> np.ndarray:
    """Which documents (by index) are validation: splitmix64(index) / 2**64 < val_share."""
    if val_share <= 0:
        return np.zeros(len(indices), dtype=bool)
    z = indices.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return z < np.uint64(min(int(val_share * 2.0**64), 2**64 - 1))


@dataclass
class _SplitWriter:
    """Appends whole documents to the open shard of one split; closes it at shard_tokens or more."""

    root: Path
    split: str
    dtype: np.dtype
    shard_tokens: int
    shards: list[Shard] = field(default_factory=list)
    tokens: int = 0  # in the open shard
    docs: int = 0

    def __post_init__(self) -> None:
        (self.root / self.split).mkdir(parents=True, exist_ok=True)
        self._files: tuple | None = None  # (tokens file, docs file, tokens sha256, docs sha256) while open

    @classmethod
    def resumed(cls, root: Path, split: str, dtype: np.dtype, shard_tokens: int, saved: dict | None):
        w = cls(root, split, dtype, shard_tokens)
        if saved:
            w.shards = [Shard(**s) for s in saved["shards"]]
            w.tokens, w.docs = int(saved["tokens"]), int(saved["docs"])
            if w.tokens:
                w._open(resume=True)
        return w

    def _name(self, ext: str) -> str:
        return f"{self.split}/shard-{len(self.shards):05d}.{ext}"

    def _open(self, resume: bool = False) -> None:
        files = []
        for ext, size in (("tokens", self.tokens * self.dtype.itemsize), ("docs", self.docs * DOCS_DTYPE.itemsize)):
            path = self.root / f"{self._name(ext)}.partial"
            if resume:
                closed = self.root / self._name(ext)
                if not path.exists() and closed.exists():  # closed, then killed before the state recorded it
                    os.replace(closed, path)
                if not path.exists() or path.stat().st_size < size:
                    raise PrepareError(
                        f"--out {self.root}: the unfinished shard {path.name} is missing or shorter than "
                        f"{STATE_DIR} records; pass --overwrite to start over"
                    )
            f = open(path, "r+b" if resume else "w+b")
            f.truncate(size)  # anything written after the last checkpoint is dropped and written again
            h = hashlib.sha256()
            f.seek(0)
            while block := f.read(1 << 22):
                h.update(block)
            files.append((f, h))
        self._files = (files[0][0], files[1][0], files[0][1], files[1][1])

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> bool:
        """Append documents (their tokens back to back and each one's length). True if a shard was closed."""
        ends = np.cumsum(lengths)
        closed, d, base = False, 0, 0
        while d < len(lengths):
            # the first document whose end reaches the shard size is the shard's last
            last = int(np.searchsorted(ends, base + self.shard_tokens - self.tokens, side="left"))
            last = min(last, len(lengths) - 1)
            stop = int(ends[last])
            self._append(tokens[base:stop], self.tokens + ends[d : last + 1] - base)
            d, base = last + 1, stop
            if self.tokens >= self.shard_tokens:
                self._close()
                closed = True
        return closed

    def _append(self, tokens: np.ndarray, doc_ends: np.ndarray) -> None:
        if self._files is None:
            self._open()
        assert self._files is not None
        ftok, fdoc, htok, hdoc = self._files
        for f, h, data in (
            (ftok, htok, tokens.astype(self.dtype).tobytes()),
            (fdoc, hdoc, doc_ends.astype(DOCS_DTYPE).tobytes()),
        ):
            f.write(data)
            h.update(data)
        self.tokens += len(tokens)
        self.docs += len(doc_ends)

    def sync(self) -> dict:
        """Flush the open shard to disk; the state that resumes this split."""
        if self._files is not None:
            for f in self._files[:2]:
                f.flush()
                os.fsync(f.fileno())
        return {"shards": [asdict(s) for s in self.shards], "tokens": self.tokens, "docs": self.docs}

    def _close(self) -> None:
        self.sync()
        assert self._files is not None
        ftok, fdoc, htok, hdoc = self._files
        ftok.close()
        fdoc.close()
        names = self._name("tokens"), self._name("docs")
        for name in names:
            os.replace(self.root / f"{name}.partial", self.root / name)
        self.shards.append(Shard(names[0], names[1], self.tokens, self.docs, htok.hexdigest(), hdoc.hexdigest()))
        self._files, self.tokens, self.docs = None, 0, 0

    def finish(self) -> Split:
        if self.docs:
            self._close()
        return Split(list(self.shards))


@dataclass
class _Tokens:
    tokens: np.ndarray
    lengths: np.ndarray  # per kept document, EOS included
    skipped: int  # documents with no tokens (empty text), dropped


@dataclass
class _WorkerSetup:
    tokenizer: str
    eos: bool
    text_key: str
    dtype: str
    quiet_threads: bool  # several worker processes: each encodes on one thread instead of all cores


_worker: tuple[DocumentTokenizer, _WorkerSetup] | None = None


def _init_worker(setup: _WorkerSetup) -> None:
    global _worker
    if setup.quiet_threads:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker = (load_tokenizer(setup.tokenizer, setup.eos), setup)


def _tokenize(piece: Piece) -> _Tokens:
    assert _worker is not None
    tok, setup = _worker
    docs = read_documents(piece, setup.text_key)
    ids: list[np.ndarray] = []
    for b in range(0, len(docs), ENCODE_BATCH):
        ids += tok.encode_batch(docs[b : b + ENCODE_BATCH])
    kept = [a for a in ids if len(a)]
    tokens, lengths = token_array(kept, tok.info.eos_id, np.dtype(setup.dtype))
    return _Tokens(tokens, lengths, len(ids) - len(kept))


def _tokenized(
    todo: Iterator[tuple[int, Piece]], setup: _WorkerSetup, workers: int
) -> Iterator[tuple[int, int, _Tokens]]:
    """(piece index, piece weight, its tokens) in piece order, tokenized by `workers` processes (1: this one)."""
    if workers == 1:
        _init_worker(setup)
        for i, piece in todo:
            yield i, piece.weight, _tokenize(piece)
        return
    # fork: workers start at once and inherit the imports; nothing in this process has started a tokenizer's
    # thread pool yet (it only loaded the definition), so the children's pools are safe
    pool = ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("fork"), initializer=_init_worker, initargs=(setup,)
    )
    window: deque[tuple[int, int, Future]] = deque()
    try:
        for i, piece in todo:
            window.append((i, piece.weight, pool.submit(_tokenize, piece)))
            if len(window) >= 2 * workers:  # bounded: a corpus is never read ahead into memory
                i0, w0, fut = window.popleft()
                yield i0, w0, fut.result()
        while window:
            i0, w0, fut = window.popleft()
            yield i0, w0, fut.result()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


class _Run:
    def __init__(
        self,
        opts: PrepareOptions,
        tok: DocumentTokenizer,
        dtype: np.dtype,
        files: list[InputFile],
        state: dict,
        on_progress: OnProgress | None,
    ) -> None:
        self.opts, self.tok, self.files, self.state = opts, tok, files, state
        self.on_progress = on_progress
        saved = state["splits"]
        self.writers = {s: _SplitWriter.resumed(opts.out, s, dtype, opts.shard_tokens, saved.get(s)) for s in SPLITS}
        self.setup = _WorkerSetup(opts.tokenizer, opts.eos, opts.text_key, dtype.name, opts.workers > 1)
        self.documents, self.skipped = int(state["documents"]), int(state["skipped"])
        self.next_piece = int(state["next_piece"])
        self.tokens_this_run = 0
        self.splits: dict[str, Split] = {}

    def go(self) -> None:
        total = sum(f.size for f in self.files)
        done = 0
        all_pieces = enumerate(pieces(self.files, self.opts.piece_bytes))

        def remaining() -> Iterator[tuple[int, Piece]]:
            """The pieces left, read lazily; the ones finished before a restart count as done."""
            nonlocal done
            for i, piece in all_pieces:
                if i < self.next_piece:
                    done += piece.weight
                    continue
                yield i, piece

        last_sync = time.monotonic()
        for i, weight, result in _tokenized(remaining(), self.setup, self.opts.workers):
            closed = self._write(result)
            self.next_piece = i + 1
            done += weight
            if closed or time.monotonic() - last_sync > CHECKPOINT_EVERY_S:
                self._checkpoint()
                last_sync = time.monotonic()
            if self.on_progress is not None:
                self.on_progress(done, total, self.tokens_this_run)
        self.splits = {s: w.finish() for s, w in self.writers.items()}
        self._checkpoint()

    def _write(self, r: _Tokens) -> bool:
        n = len(r.lengths)
        val = held_out(np.arange(self.documents, self.documents + n, dtype=np.int64), self.opts.val_share)
        self.documents += n
        self.skipped += r.skipped
        self.tokens_this_run += len(r.tokens)
        if not val.any():
            return self.writers["train"].add(r.tokens, r.lengths)
        mask = np.repeat(val, r.lengths)
        closed = self.writers["val"].add(r.tokens[mask], r.lengths[val])
        return self.writers["train"].add(r.tokens[~mask], r.lengths[~val]) or closed

    def _checkpoint(self) -> None:
        splits = {s: w.sync() for s, w in self.writers.items()}  # data on disk before the state that counts it
        state = {
            "args": self.state["args"],
            "next_piece": self.next_piece,
            "documents": self.documents,
            "skipped": self.skipped,
            "splits": splits,
        }
        _write_json(self.opts.out / STATE_DIR / "state.json", state)
