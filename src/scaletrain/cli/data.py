"""`scaletrain data prepare|inspect`: turn a corpus into token shards, and look into a prepared dataset."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from scaletrain.cli.errors import fail
from scaletrain.exit_codes import EXIT_FAILED

if TYPE_CHECKING:
    from scaletrain.data.tabular_prepare import TabularPrepareOptions

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


@click.group()
def data() -> None:
    """Prepare a corpus into token shards; inspect a prepared dataset."""


@data.command("prepare")
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Folder to write the dataset to.")
@click.option(
    "--tokenizer",
    default=None,
    metavar="PATH|bytes",
    help="A Hugging Face tokenizer folder or tokenizer.json (read locally, nothing downloaded), or `bytes`: "
    "UTF-8 bytes as ids 0..255 (EOS 256, vocabulary 257; 256 with --no-eos). Required but for --format images, "
    "image-text and tabular.",
)
@click.option("--text-key", default="text", show_default=True, help="JSON key / column holding each document.")
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Processes reading and tokenizing (default: the CPUs this process may use). The output is the same "
    "for any number.",
)
@click.option(
    "--eos/--no-eos",
    default=True,
    show_default=True,
    help="Append the EOS token after each document (text; a completion without a chat template).",
)
@click.option(
    "--val-share",
    type=float,
    default=0.01,
    show_default=True,
    help="Share of documents (images, rows) held out for validation (whole documents, chosen by a hash of their "
    "index).",
)
@click.option(
    "--shard-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Close a shard once it holds this many tokens (whole documents; default 100,000,000).",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace a dataset (or unfinished prepare) made with other arguments; --format tabular: a tabular dataset "
    "already in --out.",
)
@click.option("--progress/--no-progress", default=None, help="Progress bar on stderr (default: when it is a terminal).")
@click.option(
    "--format",
    "data_format",
    type=click.Choice(["text", "chat", "prompt-completion", "images", "image-text", "tabular"]),
    default="text",
    show_default=True,
    help="text: documents, every token trained. chat: records holding a messages list, rendered with the "
    "tokenizer's chat template, loss on the assistant turns only. prompt-completion: two fields, loss on the "
    "completion only. images: a class-per-folder image tree or a .jsonl of path/label records, into WebDataset "
    "tar shards (no tokenizer). image-text: .jsonl/.parquet rows of an image path and a caption or a chat "
    "messages list, into the same shards (tokenized in training by the model's own processor). tabular: click "
    "logs (Parquet, CSV, JSON Lines, Criteo's headerless TSV) of a 0/1 label, dense and categorical columns, into "
    "memory-mappable .npy arrays of floats and hashed ids (no tokenizer).",
)
@click.option(
    "--shard-images",
    type=click.IntRange(min=1),
    default=10_000,
    show_default=True,
    help="--format images / image-text: images per tar shard.",
)
@click.option(
    "--skip-bad-images",
    is_flag=True,
    help="--format images: leave unreadable images out (counted in the manifest) instead of stopping at the first.",
)
@click.option(
    "--messages-key", default="messages", show_default=True, help="--format chat / image-text: the messages list's key."
)
@click.option("--image-key", default="image", show_default=True, help="--format image-text: the image path's key.")
@click.option("--caption-key", default="caption", show_default=True, help="--format image-text: the caption's key.")
@click.option("--prompt-key", default="prompt", show_default=True, help="--format prompt-completion: the prompt's key.")
@click.option(
    "--completion-key", default="completion", show_default=True, help="--format prompt-completion: the answer's key."
)
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="chat / prompt-completion: the longest sample kept whole (default 4096 tokens; see --overlong).",
)
@click.option(
    "--overlong",
    type=click.Choice(["truncate", "drop"]),
    default=None,
    help="chat / prompt-completion: cut a sample over --max-tokens to that length, or leave it out (default "
    "truncate); the manifest counts both.",
)
@click.option("--label-col", default=None, help="--format tabular: the 0/1 label's column (default label).")
@click.option(
    "--dense-cols",
    default=None,
    metavar="A,B,...",
    help="--format tabular: the numeric feature columns (float32, missing as 0). With --sparse-cols unset too, "
    "the inputs must be Criteo TSVs (label, I1..I13 dense, C1..C26 sparse).",
)
@click.option(
    "--sparse-cols",
    default=None,
    metavar="X,Y,...",
    help="--format tabular: the categorical columns, each value hashed to a stable int64 id (missing: id 0).",
)
@click.option(
    "--dense-transform",
    type=click.Choice(["log1p", "none"]),
    default=None,
    help="--format tabular: log1p is log(1 + max(x, 0)) on each dense value, as DLRM's Criteo preprocessing "
    "does (default); none keeps the values.",
)
def prepare_cmd(
    inputs: tuple[str, ...],
    out: Path,
    tokenizer: str,
    text_key: str,
    workers: int | None,
    eos: bool,
    val_share: float,
    shard_tokens: int | None,
    overwrite: bool,
    progress: bool | None,
    data_format: str,
    messages_key: str,
    prompt_key: str,
    completion_key: str,
    max_tokens: int | None,
    overlong: str | None,
    shard_images: int,
    skip_bad_images: bool,
    image_key: str,
    caption_key: str,
    label_col: str | None,
    dense_cols: str | None,
    sparse_cols: str | None,
    dense_transform: str | None,
) -> None:
    """Tokenize INPUT... (text files or folders, JSON Lines (.jsonl, .jsonl.gz), Parquet, `datasets.save_to_disk`
    folders) into token shards with a manifest in --out (--format images, image-text and tabular: see --format).

    A text file is one document. With --format chat or prompt-completion each record is one sample and a loss
    mask beside the tokens says which tokens are trained (the answers). Rerunning an interrupted prepare with the
    same arguments finishes it without redoing finished shards; manifest.json is written last, so an unfinished
    folder never looks complete.
    """
    from concurrent.futures.process import BrokenProcessPool

    from scaletrain.config.folders import check_writable_folder
    from scaletrain.data.prepare import PrepareError, PrepareOptions, prepare

    try:
        check_writable_folder(out, "--out")
    except ValueError as e:
        fail(str(e))
    tabular = {"--label-col": label_col, "--dense-cols": dense_cols, "--sparse-cols": sparse_cols,
               "--dense-transform": dense_transform}  # fmt: skip
    if data_format == "tabular":
        _refuse_options_of_other_formats()
        _prepare_tabular(inputs, out, _tabular_options(label_col, dense_cols, sparse_cols, val_share,
                                                       dense_transform, overwrite))  # fmt: skip
        return
    for option, given in tabular.items():
        if given is not None:
            fail(f"{option}: applies to --format tabular; drop it, or pass --format tabular")
    if data_format in ("images", "image-text"):
        _prepare_images(inputs, out, val_share, shard_images, skip_bad_images, data_format,
                        (image_key, caption_key, messages_key))  # fmt: skip
        return
    if tokenizer is None:
        fail(f"--tokenizer: required for --format {data_format}; give a tokenizer folder, tokenizer.json or `bytes`")
    if data_format == "text":
        for value, name in ((max_tokens, "--max-tokens"), (overlong, "--overlong")):
            if value is not None:
                fail(f"{name}: applies to --format chat or prompt-completion; drop it, or pass --format")
    opts = PrepareOptions(
        inputs=list(inputs),
        out=out,
        tokenizer=tokenizer,
        text_key=text_key,
        workers=workers or len(os.sched_getaffinity(0)),
        eos=eos,
        val_share=val_share,
        overwrite=overwrite,
        format=data_format,
        messages_key=messages_key,
        prompt_key=prompt_key,
        completion_key=completion_key,
        overlong=overlong or "truncate",
    )
    if shard_tokens is not None:
        opts.shard_tokens = shard_tokens
    if max_tokens is not None:
        opts.max_tokens = max_tokens
    show = sys.stderr.isatty() if progress is None else progress
    bar = _ProgressBar() if show else None
    try:
        result = prepare(opts, on_progress=bar.update if bar else None)
    except PrepareError as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted; rerun the same command to finish (finished shards are kept)", code=EXIT_INTERRUPTED)
    except BrokenProcessPool:
        fail("a worker process died (out of memory?); rerun the same command to resume", code=EXIT_FAILED)
    except OSError as e:
        fail(f"{e.filename or out}: {e.strerror or e}; rerun the same command to resume", code=EXIT_FAILED)
    finally:
        if bar is not None:
            bar.stop()
    m = result.manifest
    if result.already_done:
        click.echo(f"{out}: already prepared with these arguments; nothing to do")
        return
    train, val = m.splits["train"], m.splits["val"]
    resumed = f", resumed at piece {result.resumed_from_piece}" if result.resumed_from_piece else ""
    rate = result.tokens_this_run / max(result.seconds, 1e-9)
    click.echo(
        f"{out}: train {train.num_documents:,} documents {train.num_tokens:,} tokens in {len(train.shards)} "
        f"shard(s), val {val.num_documents:,} documents {val.num_tokens:,} tokens; {m.dtype}, vocabulary "
        f"{m.tokenizer.vocab_size:,}; {result.seconds:.1f} s, {rate:,.0f} tokens/s with {opts.workers} "
        f"worker(s){resumed}"
    )
    if opts.masked:
        src = m.source
        click.echo(
            f"trained tokens: train {_share(train.num_trained, train.num_tokens)}, val "
            f"{_share(val.num_trained, val.num_tokens)}; samples over {opts.max_tokens:,} tokens truncated "
            f"{src['samples_truncated']:,}, dropped {src['samples_dropped_overlong']:,}; without a trained token "
            f"dropped {src['samples_dropped_untrained']:,}"
        )


def _prepare_images(
    inputs: tuple[str, ...],
    out: Path,
    val_share: float,
    shard_images: int,
    skip_bad: bool,
    data_format: str = "images",
    keys: tuple[str, str, str] = ("image", "caption", "messages"),
) -> None:
    from scaletrain.data.image_prepare import (
        ImagePrepareError,
        ImagePrepareOptions,
        prepare_image_text,
        prepare_images,
    )

    options = ImagePrepareOptions(val_share=val_share, shard_images=shard_images, skip_bad=skip_bad,
                                  image_key=keys[0], text_key=keys[1], messages_key=keys[2])  # fmt: skip
    write = prepare_image_text if data_format == "image-text" else prepare_images
    try:
        m = write([Path(p) for p in inputs], out, options)
    except ImagePrepareError as e:
        fail(str(e))
    except OSError as e:
        fail(f"{e.filename or out}: {e.strerror or e}", code=EXIT_FAILED)
    train, val = m.splits["train"], m.splits["val"]
    skipped = f", {m.skipped:,} unreadable image(s) skipped" if m.skipped else ""
    what = "image-text rows" if data_format == "image-text" else f"{m.num_labels} classes"
    click.echo(f"{out}: {what}; train {train['samples']:,} images in {len(train['shards'])} "
               f"shard(s), val {val['samples']:,} images{skipped}")  # fmt: skip


# options of the token and image formats, by their parameter names: given with --format tabular they are refused
_NOT_TABULAR = ("tokenizer", "text_key", "workers", "eos", "shard_tokens", "shard_images", "skip_bad_images",
                "messages_key", "image_key", "caption_key", "prompt_key", "completion_key", "max_tokens", "overlong")  # fmt: skip


def _refuse_options_of_other_formats() -> None:
    from click.core import ParameterSource

    ctx = click.get_current_context()
    for param in ctx.command.params:
        if param.name in _NOT_TABULAR and ctx.get_parameter_source(param.name) != ParameterSource.DEFAULT:
            flag = max(param.opts, key=len)
            fail(f"{flag}: does not apply to --format tabular; drop it (tabular takes --label-col, --dense-cols, "
                 f"--sparse-cols, --val-share, --dense-transform, --overwrite)")  # fmt: skip


def _tabular_options(
    label_col: str | None,
    dense_cols: str | None,
    sparse_cols: str | None,
    val_share: float,
    dense_transform: str | None,
    overwrite: bool,
) -> TabularPrepareOptions:
    from scaletrain.data.tabular_prepare import TabularPrepareOptions

    def names(value: str | None, option: str) -> tuple[str, ...]:
        cols = tuple(c.strip() for c in (value or "").split(","))
        if value is not None and not all(cols):
            fail(f"{option}: {value!r} has an empty name; give comma-separated column names, e.g. a,b")
        return cols if value is not None else ()

    return TabularPrepareOptions(
        label_col=label_col or "label",
        dense_cols=names(dense_cols, "--dense-cols"),
        sparse_cols=names(sparse_cols, "--sparse-cols"),
        val_share=val_share,
        dense_transform=dense_transform or "log1p",
        overwrite=overwrite,
    )


def _prepare_tabular(inputs: tuple[str, ...], out: Path, opts: TabularPrepareOptions) -> None:
    import time

    from scaletrain.data.tabular_prepare import TabularPrepareError, prepare_tabular

    start = time.monotonic()
    try:
        m = prepare_tabular([Path(p) for p in inputs], out, opts)
    except TabularPrepareError as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted; nothing was written, rerun the same command", code=EXIT_INTERRUPTED)
    except OSError as e:
        fail(f"{e.filename or out}: {e.strerror or e}", code=EXIT_FAILED)
    seconds = time.monotonic() - start
    train, val = m.splits["train"], m.splits["val"]
    rate = (train["samples"] + val["samples"]) / max(seconds, 1e-9)
    click.echo(f"{out}: {m.num_dense} dense, {m.num_sparse} sparse columns; train {train['samples']:,} rows "
               f"({100 * train['positives'] / max(train['samples'], 1):.1f}% positive), val {val['samples']:,} rows; "
               f"{seconds:.1f} s, {rate:,.0f} rows/s")  # fmt: skip


def _share(part: int | None, whole: int) -> str:
    if part is None:
        return f"{whole:,} (all)"
    return f"{part:,} of {whole:,} ({100 * part / max(whole, 1):.1f}%)"


class _ProgressBar:
    """Input bytes done with ETA, and tokens/s, on stderr (rich)."""

    def __init__(self) -> None:
        import time

        from rich.console import Console
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

        self._time = time.monotonic
        self._start = self._time()
        self._progress = Progress(
            TextColumn("prepare"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self._task = self._progress.add_task("prepare", total=None, rate="")
        self._progress.start()

    def update(self, done: int, total: int, tokens: int) -> None:
        rate = tokens / max(self._time() - self._start, 1e-9)
        self._progress.update(self._task, completed=done, total=total, rate=f"{rate:,.0f} tokens/s")

    def stop(self) -> None:
        self._progress.stop()


@data.command("inspect")
@click.argument("folder", type=click.Path(path_type=Path))
@click.option("--verify", is_flag=True, help="Check every file's sha256 against the manifest (reads all the data).")
@click.option(
    "--sample-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Tokens of the first sample to show (default 64; 1024 for chat / prompt-completion data).",
)
def inspect_cmd(folder: Path, verify: bool, sample_tokens: int | None) -> None:
    """Counts, shards, dtype and tokenizer of a prepared dataset, and a decoded sample; for chat and
    prompt-completion data the sample's untrained text is shown in [ ] (dimmed on a terminal), trained text plain.
    A tabular dataset: its columns, splits, positives, distinct ids per sparse column and its first row."""
    import numpy as np

    from scaletrain.data.tabular import is_tabular_folder

    if is_tabular_folder(folder):
        for name, given in (("--verify", verify), ("--sample-tokens", sample_tokens is not None)):
            if given:
                fail(f"{name}: applies to token datasets, {folder} is tabular; drop it")
        _inspect_tabular(folder)
        return

    from scaletrain.data.manifest import (
        DOCS_DTYPE,
        MASK_DTYPE,
        DatasetError,
        check_shard_sizes,
        read_manifest,
        verify_shards,
    )
    from scaletrain.data.tokenizer import tokenizer_for

    try:
        m = read_manifest(folder)
    except DatasetError as e:
        fail(str(e))
    t = m.tokenizer
    eos = "none" if t.eos_id is None else str(t.eos_id)
    click.echo(f"{folder}: {m.format} v{m.version}, {m.dtype} tokens ({m.created_by or 'unknown maker'})")
    click.echo(f"tokenizer: {t.kind} {t.name} (vocabulary {t.vocab_size:,}, EOS {eos}, sha256 {t.fingerprint[:16]})")
    src = m.source
    if src:
        key = "" if m.masked else f", text key {src.get('text_key')!r}"
        click.echo(
            f"made from: {src.get('files', '?')} file(s){key}, val share "
            f"{src.get('val_share')}, shard tokens {src.get('shard_tokens', '?'):,}"
        )
    if m.masked:
        keys = " ".join(f"{k} {src[k]!r}" for k in ("messages_key", "prompt_key", "completion_key") if k in src)
        click.echo(
            f"format: {src.get('format', '?')} ({keys}), loss on the answers only; samples over "
            f"{src.get('max_tokens', '?'):,} tokens: {src.get('samples_truncated', 0):,} truncated, "
            f"{src.get('samples_dropped_overlong', 0):,} dropped; {src.get('samples_dropped_untrained', 0):,} "
            "without a trained token dropped"
        )
    for name, split in m.splits.items():
        trained = "" if split.num_trained is None else f" ({_share(split.num_trained, split.num_tokens)} trained)"
        click.echo(
            f"{name}: {split.num_documents:,} documents, {split.num_tokens:,} tokens{trained}, "
            f"{len(split.shards)} shard(s)"
        )
        for s in split.shards[:8]:
            click.echo(f"  {s.tokens}  {s.num_tokens:,} tokens  {s.num_documents:,} documents")
        if len(split.shards) > 8:
            click.echo(f"  ... {len(split.shards) - 8} more")
    try:
        (verify_shards if verify else check_shard_sizes)(folder, m)
    except DatasetError as e:
        fail(str(e), code=EXIT_FAILED)
    files = sum(len(s.files()) for split in m.splits.values() for s in split.shards)
    click.echo(f"files: {files} present with the recorded sizes" + (", sha256 verified" if verify else ""))

    shards = m.splits["train"].shards or m.splits.get("val", m.splits["train"]).shards
    if not shards:
        return
    first = shards[0]
    count = sample_tokens or (1024 if first.mask is not None else 64)
    end = int(np.fromfile(folder / first.docs, dtype=DOCS_DTYPE, count=1)[0])
    ids = np.fromfile(folder / first.tokens, dtype=np.dtype(m.dtype), count=min(end, count)).tolist()
    click.echo(f"sample ({first.tokens}, document 0, first {len(ids)} of {end} tokens): {ids}")
    tok = tokenizer_for(t)
    if tok is None:
        click.echo(f"decoded: (tokenizer {t.name} not found or changed since prepare; ids only)")
    elif first.mask is None:
        click.echo(f"decoded: {json.dumps(tok.decode(ids), ensure_ascii=False)}")
    else:
        mask = np.fromfile(folder / first.mask, dtype=MASK_DTYPE, count=len(ids)).astype(bool)
        click.echo(
            f"trained: {_share(int(mask.sum()), len(ids))} tokens of this sample; untrained text in [ ] (dimmed on "
            "a terminal), trained text plain:"
        )
        click.echo(marked_text(tok.decode, ids, mask))


def _inspect_tabular(folder: Path) -> None:
    from scaletrain.data.tabular import TabularDataError, open_split, read_tabular_manifest

    try:
        m = read_tabular_manifest(folder)
        arrays = {split: open_split(folder, split) for split in m.splits}
    except TabularDataError as e:
        fail(str(e), code=EXIT_FAILED)
    click.echo(f"{folder}: tabular v{m.version} ({m.created_by or 'unknown maker'}), from {len(m.sources)} file(s)")
    click.echo(f"label: {m.label_col}")
    click.echo(f"dense ({m.num_dense}, float32, {m.dense_transform}): {', '.join(m.dense_cols) or '-'}")
    click.echo(f"sparse ({m.num_sparse}, int64 hashed ids): {', '.join(m.sparse_cols) or '-'}")
    for name, counts in m.splits.items():
        click.echo(f"{name}: {counts['samples']:,} rows, {_share(counts['positives'], counts['samples'])} positive")
    if m.sparse_cols:
        distinct = [f"{c} {'>=' if c in m.capped else ''}{m.distinct_ids[c]:,}" for c in m.sparse_cols]
        click.echo(f"distinct ids in train: {', '.join(distinct)}")
    click.echo("files: " + ", ".join(f"{s}/{{dense,sparse,labels}}.npy" for s in arrays) + " present with the "
               "manifest's shapes")  # fmt: skip
    split = "train" if m.splits["train"]["samples"] else "val"
    dense, sparse, labels = arrays[split]
    if len(labels):
        click.echo(f"sample ({split} row 0): label {labels[0]:g}")
        click.echo("  dense: " + ", ".join(f"{c}={float(v):.6g}" for c, v in zip(m.dense_cols, dense[0])))
        click.echo("  sparse: " + ", ".join(f"{c}={int(v)}" for c, v in zip(m.sparse_cols, sparse[0])))


def marked_text(decode, ids: list[int], trained) -> str:
    """The decoded ids with each run of untrained tokens shown as a dim `[...]`, trained runs plain."""
    out, start = [], 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or trained[k] != trained[start]:
            text = decode(ids[start:k])
            out.append(text if trained[start] else click.style(f"[{text}]", dim=True))
            start = k
    return "".join(out)
