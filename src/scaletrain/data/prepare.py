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

`format` chat / prompt-completion: each record is one sample, rendered by data/chat.py into tokens and a loss mask
written beside each shard (`.mask`, restartable and checksummed like the rest); samples over `max_tokens` are
truncated or dropped (`overlong`), and counted in the manifest. `text` writes exactly what it always did.
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

from scaletrain.data.chat import (
    CHAT,
    FORMATS,
    PROMPT_COMPLETION,
    TEXT,
    ChatEncoder,
    SampleError,
    TemplateError,
    read_chat_template,
    template_sha256,
    tokenizer_folder,
)
from scaletrain.data.manifest import (
    DOCS_DTYPE,
    MANIFEST,
    MASK_DTYPE,
    MASKED_VERSION,
    PLAIN_VERSION,
    SPLITS,
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
    check_record_keys,
    check_text_key,
    find_inputs,
    pieces,
    read_documents,
    read_records,
    where,
)
from scaletrain.data.tokenizer import DocumentTokenizer, TokenizerError, load_tokenizer, token_array

PREPARE_VERSION = 1  # bump when the same arguments would give different shards (e.g. a new validation hash)
STATE_DIR = ".prepare-state"
DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB per uint16 shard: few files, each memory-mapped cheaply
ENCODE_BATCH = 1024  # documents per encode_batch call
CHECKPOINT_EVERY_S = 5.0
DEFAULT_MAX_TOKENS = 4096  # chat / prompt-completion samples longer than this are truncated or dropped (--overlong)
OVERLONG = ("truncate", "drop")


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
    format: str = TEXT  # text | chat | prompt-completion (data/chat.py)
    messages_key: str = "messages"
    prompt_key: str = "prompt"
    completion_key: str = "completion"
    max_tokens: int = DEFAULT_MAX_TOKENS  # chat / prompt-completion only
    overlong: str = "truncate"  # what happens to a sample over max_tokens: truncate | drop

    @property
    def masked(self) -> bool:
        return self.format != TEXT

    def record_keys(self) -> tuple[tuple[str, ...], str]:
        """The keys each record must hold, and the option that names them (for messages)."""
        if self.format == CHAT:
            return (self.messages_key,), "pass --messages-key with the key of the messages list"
        return (self.prompt_key, self.completion_key), "pass --prompt-key / --completion-key with the record's keys"


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
    if opts.format not in FORMATS:
        raise PrepareError(f"--format: {opts.format!r} is not one of {', '.join(FORMATS)}")
    if opts.max_tokens < 1:
        raise PrepareError(f"--max-tokens: must be >= 1 (got {opts.max_tokens})")
    if opts.overlong not in OVERLONG:
        raise PrepareError(f"--overlong: {opts.overlong!r} is not one of {', '.join(OVERLONG)}")
    template = read_chat_template(tokenizer_folder(opts.tokenizer)) if opts.masked else None
    try:
        tok = load_tokenizer(opts.tokenizer, _appends_eos(opts, template))
        if opts.format == CHAT and template is None:
            raise PrepareError(
                f"--tokenizer {opts.tokenizer}: no chat template (chat_template in tokenizer_config.json or "
                "chat_template.jinja); --format chat renders with the tokenizer's own template: use the model's "
                "tokenizer folder, or --format prompt-completion / text"
            )
        dtype = token_dtype(tok.info.vocab_size)
        files = find_inputs(opts.inputs, exclude=opts.out)
        for f in files:
            if opts.masked:
                check_record_keys(f, *opts.record_keys())
            else:
                check_text_key(f, opts.text_key)
        if opts.masked:
            _encoder(opts, tok, template)  # the template loads with transformers, before anything is written
    except (TokenizerError, InputError, DatasetError, TemplateError) as e:
        raise PrepareError(str(e)) from None
    args = _arguments(opts, tok, files, template)
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
        run = _Run(opts, tok, dtype, files, state, on_progress, template)
        run.go()
        train = run.splits["train"]
        if train.num_documents == 0:
            what = "--text-key" if not opts.masked else "the assistant turns and --max-tokens / --overlong"
            raise InputError(
                f"no {'samples with trained tokens' if opts.masked else 'documents with text'} in {len(files)} input "
                "file(s)"
                + (f" ({run.documents} went to validation; lower --val-share)" if run.documents else "")
                + f"; check the inputs and {what}"
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
            **(_masked_source(opts, template, run) if opts.masked else {}),
        },
        created_by=f"scaletrain {_version()} data prepare",
        version=MASKED_VERSION if opts.masked else PLAIN_VERSION,
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


def _appends_eos(opts: PrepareOptions, template: str | None) -> bool:
    """Whether prepare appends the tokenizer's EOS: after each text document, and after a completion without a
    chat template; a chat template writes its own end-of-turn tokens."""
    if opts.format == TEXT or (opts.format == PROMPT_COMPLETION and template is None):
        return opts.eos
    return False


def _encoder(opts: PrepareOptions, tok: DocumentTokenizer, template: str | None) -> ChatEncoder:
    try:
        return ChatEncoder(tokenizer_folder(opts.tokenizer), template, tok, tok.info.eos_id)
    except (OSError, ValueError) as e:  # transformers cannot load the folder as a tokenizer
        raise TemplateError(f"--tokenizer {opts.tokenizer}: transformers cannot load it ({_one_line(e)})") from None


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _masked_source(opts: PrepareOptions, template: str | None, run: _Run) -> dict:
    """What the manifest records about a chat / prompt-completion prepare: its options and what it cut."""
    keys = {"messages_key": opts.messages_key} if opts.format == CHAT else {
        "prompt_key": opts.prompt_key, "completion_key": opts.completion_key,
    }  # fmt: skip
    return {
        "format": opts.format,
        **keys,
        "chat_template_sha256": template_sha256(template),
        "max_tokens": opts.max_tokens,
        "overlong": opts.overlong,
        "samples_truncated": run.truncated,
        "samples_dropped_overlong": run.dropped,
        "samples_dropped_untrained": run.untrained,
    }


def _arguments(opts: PrepareOptions, tok: DocumentTokenizer, files: list[InputFile], template: str | None) -> dict:
    """Everything the shards depend on (inputs by path, size and mtime), for the same-arguments check."""
    masked = {}
    if opts.masked:  # text keeps its arguments (and so its manifest) exactly as before
        masked = {
            "format": opts.format,
            "record_keys": list(opts.record_keys()[0]),
            "chat_template_sha256": template_sha256(template),
            "max_tokens": opts.max_tokens,
            "overlong": opts.overlong,
        }
    return {
        **masked,
        "prepare_version": PREPARE_VERSION,
        "format_version": MASKED_VERSION if opts.masked else PLAIN_VERSION,
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
    """Appends whole documents (and their loss masks, when `masked`) to the open shard of one split; closes it at
    shard_tokens or more."""

    root: Path
    split: str
    dtype: np.dtype
    shard_tokens: int
    masked: bool = False
    shards: list[Shard] = field(default_factory=list)
    tokens: int = 0  # in the open shard
    docs: int = 0
    trained: int = 0  # mask ones in the open shard

    def __post_init__(self) -> None:
        (self.root / self.split).mkdir(parents=True, exist_ok=True)
        self._files: list[tuple] | None = None  # (file, sha256) of tokens, docs (and mask) while open

    @classmethod
    def resumed(cls, root: Path, split: str, dtype: np.dtype, shard_tokens: int, masked: bool, saved: dict | None):
        w = cls(root, split, dtype, shard_tokens, masked)
        if saved:
            w.shards = [Shard(**s) for s in saved["shards"]]
            w.tokens, w.docs, w.trained = int(saved["tokens"]), int(saved["docs"]), int(saved.get("trained", 0))
            if w.tokens:
                w._open(resume=True)
        return w

    def _name(self, ext: str) -> str:
        return f"{self.split}/shard-{len(self.shards):05d}.{ext}"

    def _kinds(self) -> list[tuple[str, int]]:
        """(file extension, bytes so far) of each file of the open shard."""
        kinds = [("tokens", self.tokens * self.dtype.itemsize), ("docs", self.docs * DOCS_DTYPE.itemsize)]
        return kinds + [("mask", self.tokens * MASK_DTYPE.itemsize)] if self.masked else kinds

    def _open(self, resume: bool = False) -> None:
        files = []
        for ext, size in self._kinds():
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
        self._files = files

    def add(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None = None) -> bool:
        """Append documents (their tokens back to back, each one's length, and the tokens' loss mask when this
        split is masked). True if a shard was closed."""
        ends = np.cumsum(lengths)
        closed, d, base = False, 0, 0
        while d < len(lengths):
            # the first document whose end reaches the shard size is the shard's last
            last = int(np.searchsorted(ends, base + self.shard_tokens - self.tokens, side="left"))
            last = min(last, len(lengths) - 1)
            stop = int(ends[last])
            part = None if mask is None else mask[base:stop]
            self._append(tokens[base:stop], self.tokens + ends[d : last + 1] - base, part)
            d, base = last + 1, stop
            if self.tokens >= self.shard_tokens:
                self._close()
                closed = True
        return closed

    def _append(self, tokens: np.ndarray, doc_ends: np.ndarray, mask: np.ndarray | None) -> None:
        if self._files is None:
            self._open()
        assert self._files is not None
        data = [tokens.astype(self.dtype).tobytes(), doc_ends.astype(DOCS_DTYPE).tobytes()]
        if self.masked:
            assert mask is not None and len(mask) == len(tokens)
            data.append(mask.astype(MASK_DTYPE).tobytes())
            self.trained += int(np.count_nonzero(mask))
        for (f, h), block in zip(self._files, data):
            f.write(block)
            h.update(block)
        self.tokens += len(tokens)
        self.docs += len(doc_ends)

    def sync(self) -> dict:
        """Flush the open shard to disk; the state that resumes this split."""
        if self._files is not None:
            for f, _ in self._files:
                f.flush()
                os.fsync(f.fileno())
        state = {"shards": [asdict(s) for s in self.shards], "tokens": self.tokens, "docs": self.docs}
        return {**state, "trained": self.trained} if self.masked else state

    def _close(self) -> None:
        self.sync()
        assert self._files is not None
        names = [self._name(ext) for ext, _ in self._kinds()]
        for (f, _), name in zip(self._files, names):
            f.close()
            os.replace(self.root / f"{name}.partial", self.root / name)
        digests = [h.hexdigest() for _, h in self._files]
        shard = Shard(names[0], names[1], self.tokens, self.docs, digests[0], digests[1])
        if self.masked:
            shard.mask, shard.sha256_mask, shard.num_trained = names[2], digests[2], self.trained
        self.shards.append(shard)
        self._files, self.tokens, self.docs, self.trained = None, 0, 0, 0

    def finish(self) -> Split:
        if self.docs:
            self._close()
        return Split(list(self.shards))


@dataclass
class _Tokens:
    tokens: np.ndarray
    lengths: np.ndarray  # per kept document, EOS included
    skipped: int  # documents with no tokens (empty text), dropped
    mask: np.ndarray | None = None  # chat / prompt-completion: 1 per token trained as a target
    truncated: int = 0  # samples cut to max_tokens
    dropped: int = 0  # samples over max_tokens left out (--overlong drop)
    untrained: int = 0  # samples left without a trained token (no assistant turn, or all of it cut off)


@dataclass
class _WorkerSetup:
    tokenizer: str
    eos: bool
    text_key: str
    dtype: str
    quiet_threads: bool  # several worker processes: each encodes on one thread instead of all cores
    format: str = TEXT
    record_keys: tuple[str, ...] = ()
    key_hint: str = ""
    template: str | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    overlong: str = "truncate"


_worker: tuple[DocumentTokenizer, _WorkerSetup, ChatEncoder | None] | None = None


def _init_worker(setup: _WorkerSetup) -> None:
    global _worker
    if setup.quiet_threads:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = load_tokenizer(setup.tokenizer, setup.eos)
    encoder = None
    if setup.format != TEXT:
        encoder = ChatEncoder(tokenizer_folder(setup.tokenizer), setup.template, tok, tok.info.eos_id)
    _worker = (tok, setup, encoder)


def _tokenize(piece: Piece) -> _Tokens:
    assert _worker is not None
    tok, setup, encoder = _worker
    if encoder is not None:
        return _encode_samples(piece, setup, encoder)
    docs = read_documents(piece, setup.text_key)
    ids: list[np.ndarray] = []
    for b in range(0, len(docs), ENCODE_BATCH):
        ids += tok.encode_batch(docs[b : b + ENCODE_BATCH])
    kept = [a for a in ids if len(a)]
    tokens, lengths = token_array(kept, tok.info.eos_id, np.dtype(setup.dtype))
    return _Tokens(tokens, lengths, len(ids) - len(kept))


def _encode_samples(piece: Piece, setup: _WorkerSetup, encoder: ChatEncoder) -> _Tokens:
    """A piece's chat or prompt-completion records as tokens with their loss mask; samples over max_tokens cut or
    left out as --overlong says, samples without a trained token left out (each counted)."""
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    out = _Tokens(np.empty(0), np.empty(0), 0)
    for position, values in read_records(piece, setup.record_keys, setup.key_hint):
        try:
            sample = encoder.chat(values[0]) if setup.format == CHAT else encoder.prompt_completion(*values)
        except (SampleError, TemplateError) as e:
            raise InputError(f"{where(piece, position)}: {e}") from None
        if not len(sample.ids):
            out.skipped += 1
            continue
        if len(sample.ids) > setup.max_tokens:
            if setup.overlong == "drop":
                out.dropped += 1
                continue
            out.truncated += 1
            sample.ids, sample.mask = sample.ids[: setup.max_tokens], sample.mask[: setup.max_tokens]
        if not sample.mask.any():
            out.untrained += 1
            continue
        ids.append(sample.ids)
        masks.append(sample.mask)
    out.tokens, out.lengths = token_array(ids, None, np.dtype(setup.dtype))
    out.mask = np.concatenate(masks) if masks else np.empty(0, dtype=MASK_DTYPE)
    return out


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
        template: str | None = None,
    ) -> None:
        self.opts, self.tok, self.files, self.state = opts, tok, files, state
        self.on_progress = on_progress
        saved = state["splits"]
        self.writers = {
            s: _SplitWriter.resumed(opts.out, s, dtype, opts.shard_tokens, opts.masked, saved.get(s)) for s in SPLITS
        }
        keys, hint = opts.record_keys() if opts.masked else ((), "")
        self.setup = _WorkerSetup(
            opts.tokenizer, tok.info.eos_id is not None, opts.text_key, dtype.name, opts.workers > 1,
            opts.format, keys, hint, template, opts.max_tokens, opts.overlong,
        )  # fmt: skip
        self.truncated, self.dropped = int(state.get("truncated", 0)), int(state.get("dropped", 0))
        self.untrained = int(state.get("untrained", 0))
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
        self.truncated, self.dropped, self.untrained = (
            self.truncated + r.truncated, self.dropped + r.dropped, self.untrained + r.untrained,
        )  # fmt: skip
        self.tokens_this_run += len(r.tokens)
        if not val.any():
            return self.writers["train"].add(r.tokens, r.lengths, r.mask)
        in_val = np.repeat(val, r.lengths)
        loss = (None, None) if r.mask is None else (r.mask[in_val], r.mask[~in_val])
        closed = self.writers["val"].add(r.tokens[in_val], r.lengths[val], loss[0])
        return self.writers["train"].add(r.tokens[~in_val], r.lengths[~val], loss[1]) or closed

    def _checkpoint(self) -> None:
        splits = {s: w.sync() for s, w in self.writers.items()}  # data on disk before the state that counts it
        state = {
            "args": self.state["args"],
            "next_piece": self.next_piece,
            "documents": self.documents,
            "skipped": self.skipped,
            "splits": splits,
            **({"truncated": self.truncated, "dropped": self.dropped, "untrained": self.untrained}
               if self.opts.masked else {}),
        }  # fmt: skip
        _write_json(self.opts.out / STATE_DIR / "state.json", state)
