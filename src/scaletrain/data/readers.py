"""Reading documents out of a user's corpus: plain text, JSON Lines (also .gz), Parquet, saved `datasets` folders.

Inputs are expanded into files in one fixed order (each argument in turn; in a folder, its files by sorted name,
then its subfolders by sorted name, recursively; hidden names skipped), and each file is cut into *pieces* that a worker process reads and tokenizes on its own:
a byte range of a JSON Lines file (cut at line ends), a Parquet row group, a row range of an Arrow file, a group
of whole text files. A gzip stream cannot be cut without reading it, so its pieces carry their lines, read by the
main process. The documents of the pieces, in piece order, are the documents of the inputs in order: how the work
is cut never changes the output.

By suffix: `.jsonl` / `.ndjson` are JSON Lines (one document per line, its text under the text key); `.parquet` is
Parquet (the text key is a column); a folder written by `datasets.save_to_disk` (state.json + .arrow files, or
dataset_dict.json with a `train` split) is read through pyarrow; anything else is one plain-text document (UTF-8).
A trailing `.gz` is decompressed first. Chat and prompt-completion data are read as records (`read_records`: the
values of given keys per JSON line or row) from the same JSON Lines, Parquet and saved-dataset inputs.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PIECE_BYTES = 4 << 20  # input bytes per piece: large enough to amortise a task, small enough to spread over workers
TEXT_GROUP_FILES = 256  # at most this many small text files in one piece
JSONL_SUFFIXES = (".jsonl", ".ndjson")


class InputError(ValueError):
    """An input that cannot be read as asked; the message is one line naming the file (and line or row)."""


@dataclass(frozen=True)
class InputFile:
    path: str  # absolute
    kind: str  # text | jsonl | parquet | arrow
    gz: bool
    size: int  # bytes on disk
    mtime_ns: int


@dataclass(frozen=True)
class Piece:
    """One unit of work: documents a worker reads on its own (or, for gzip, is handed)."""

    kind: str  # text | jsonl | parquet | arrow
    paths: tuple[str, ...]  # one file, or a group of text files
    start: int = 0  # jsonl: byte offset; parquet: row group; arrow: first row
    stop: int = 0  # jsonl: byte offset (exclusive); parquet: unused; arrow: row (exclusive)
    first_row: int = 0  # 0-based line / row of the file where the piece starts, when known (for messages)
    lines: tuple[bytes, ...] | None = None  # gzip JSON Lines: the lines themselves
    weight: int = 0  # bytes on disk this piece accounts for (progress and ETA)


def _kind(path: Path) -> tuple[str, bool]:
    name = path.name.lower()
    gz = name.endswith(".gz")
    if gz:
        name = name[:-3]
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl", gz
    if name.endswith(".parquet") and not gz:
        return "parquet", False
    return "text", gz


def _saved_dataset_files(folder: Path) -> list[Path] | None:
    """The .arrow files of a folder written by `datasets.save_to_disk`, or None if it is not one."""
    if (folder / "dataset_dict.json").is_file():
        try:
            splits = json.loads((folder / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InputError(f"{folder / 'dataset_dict.json'}: unreadable ({e})") from e
        if "train" not in splits:
            raise InputError(
                f"{folder}: a saved DatasetDict without a train split (splits: {', '.join(map(str, splits))}); "
                f"pass the split's folder, e.g. {folder / str(splits[0])}"
            )
        folder = folder / "train"
    state = folder / "state.json"
    if not state.is_file():
        return None
    try:
        names = [d["filename"] for d in json.loads(state.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"{state}: unreadable saved-dataset state ({e})") from e
    return [folder / n for n in names]


def _input_file(path: Path, kind: str | None = None) -> InputFile:
    try:
        st = path.stat()
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from e
    k, gz = (kind, False) if kind else _kind(path)
    return InputFile(str(path.resolve()), k, gz, st.st_size, st.st_mtime_ns)


def find_inputs(inputs: list[str], exclude: Path | None = None) -> list[InputFile]:
    """Expand files and folders into input files, in the order documents are read. `exclude` (the output folder)
    must not be inside an input folder."""
    found: list[InputFile] = []
    for arg in inputs:
        path = Path(arg)
        if not path.exists():
            raise InputError(f"{arg}: no such file or folder")
        if not path.is_dir():
            found.append(_input_file(path))
            continue
        if exclude is not None and (exclude.resolve() == path.resolve() or path.resolve() in exclude.resolve().parents):
            raise InputError(f"--out {exclude} is inside the input folder {arg}; choose an output folder outside it")
        before = len(found)
        arrow = _saved_dataset_files(path)
        if arrow is not None:
            found += [_input_file(p, "arrow") for p in arrow]
            continue
        for folder, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            here = Path(folder)
            if here != path and _saved_dataset_files(here) is not None:
                found += [_input_file(p, "arrow") for p in _saved_dataset_files(here) or []]
                dirs[:] = []
                continue
            found += [_input_file(here / n) for n in sorted(names) if not n.startswith(".")]
        if len(found) == before:
            raise InputError(f"{arg}: an empty folder (no input files)")
    return found


def check_text_key(f: InputFile, text_key: str) -> None:
    """Fail early (before anything is written) when a columnar file has no text column or a JSON Lines file's first
    record has no text key: the commonest mistake is a wrong --text-key."""
    if f.kind in ("parquet", "arrow"):
        names = _arrow_schema(f).names
        if text_key not in names:
            raise InputError(
                f"{f.path}: no column {text_key!r} (columns: {', '.join(names)}); pass --text-key with one of them"
            )
    elif f.kind == "jsonl":
        opener = gzip.open if f.gz else open
        try:
            with opener(f.path, "rb") as fh:
                for number, line in enumerate(fh, 1):
                    if line.strip():
                        try:
                            _json_text(line, text_key)
                        except _BadRecord as e:
                            raise InputError(f"{f.path}: line {number}: {e}") from None
                        return
        except (OSError, EOFError) as e:
            raise InputError(f"{f.path}: cannot read ({getattr(e, 'strerror', None) or e})") from e


def check_record_keys(f: InputFile, keys: tuple[str, ...], hint: str) -> None:
    """check_text_key for record formats (chat, prompt-completion): every key a column, or in the first JSON
    record; a plain-text file refused."""
    if f.kind == "text":
        raise InputError(
            f"{f.path}: a plain-text file; this format reads records (JSON Lines, Parquet or a saved dataset), "
            "or pass --format text"
        )
    if f.kind in ("parquet", "arrow"):
        names = _arrow_schema(f).names
        for key in keys:
            if key not in names:
                raise InputError(f"{f.path}: no column {key!r} (columns: {', '.join(names)}); {hint}")
        return
    opener = gzip.open if f.gz else open
    try:
        with opener(f.path, "rb") as fh:
            for number, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        _json_values(line, keys, hint)
                    except _BadRecord as e:
                        raise InputError(f"{f.path}: line {number}: {e}") from None
                    return
    except (OSError, EOFError) as e:
        raise InputError(f"{f.path}: cannot read ({getattr(e, 'strerror', None) or e})") from e


def _arrow_schema(f: InputFile):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if f.kind == "parquet":
            return pq.ParquetFile(f.path).schema_arrow
        with pa.memory_map(f.path) as source:
            return pa.ipc.open_stream(source).schema
    except (OSError, pa.ArrowException) as e:
        raise InputError(f"{f.path}: not a readable {f.kind} file ({_one_line(e)})") from e


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def pieces(files: list[InputFile], piece_bytes: int = PIECE_BYTES) -> Iterator[Piece]:
    """Every input cut into pieces, in document order. Deterministic for the same files and piece_bytes."""
    group: list[InputFile] = []
    for f in files:
        if f.kind == "text" and not f.gz:
            if group and (sum(g.size for g in group) + f.size > piece_bytes or len(group) >= TEXT_GROUP_FILES):
                yield _text_piece(group)
                group = []
            group.append(f)
            continue
        if group:
            yield _text_piece(group)
            group = []
        if f.kind == "text":  # a gzipped text file: one document, read whole by its worker
            yield Piece("text", (f.path,), weight=f.size)
        elif f.kind == "jsonl" and f.gz:
            yield from _gzip_pieces(f, piece_bytes)
        elif f.kind == "jsonl":
            yield from _jsonl_pieces(f, piece_bytes)
        elif f.kind == "parquet":
            yield from _parquet_pieces(f)
        else:
            yield from _arrow_pieces(f, piece_bytes)
    if group:
        yield _text_piece(group)


def _text_piece(group: list[InputFile]) -> Piece:
    return Piece("text", tuple(g.path for g in group), weight=sum(g.size for g in group))


def _jsonl_pieces(f: InputFile, piece_bytes: int) -> Iterator[Piece]:
    start = 0
    with open(f.path, "rb") as fh:
        while start < f.size:
            fh.seek(min(start + piece_bytes, f.size))
            if fh.tell() < f.size:
                fh.seek(fh.tell() - 1)  # a cut right after a newline stays there
                fh.readline()
            stop = min(fh.tell(), f.size)
            yield Piece("jsonl", (f.path,), start, stop, weight=stop - start)
            start = stop


def _gzip_pieces(f: InputFile, piece_bytes: int) -> Iterator[Piece]:
    try:
        with open(f.path, "rb") as raw, gzip.open(raw, "rb") as fh:
            lines: list[bytes] = []
            size = first = number = counted = 0
            for number, line in enumerate(fh):
                lines.append(line)
                size += len(line)
                if size >= piece_bytes:
                    weight = min(raw.tell(), f.size) - counted
                    counted += weight
                    yield Piece("jsonl", (f.path,), first_row=first, lines=tuple(lines), weight=weight)
                    lines, size, first = [], 0, number + 1
            if lines or counted < f.size:
                yield Piece("jsonl", (f.path,), first_row=first, lines=tuple(lines), weight=f.size - counted)
    except (OSError, EOFError) as e:
        raise InputError(f"{f.path}: not a readable gzip file ({getattr(e, 'strerror', None) or e})") from e


def _parquet_pieces(f: InputFile) -> Iterator[Piece]:
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(f.path).metadata
    first, total = 0, max(1, meta.num_rows)
    for g in range(meta.num_row_groups):
        rows = meta.row_group(g).num_rows
        # the file's bytes shared out by rows; the last group takes the rounding remainder
        weight = f.size * (first + rows) // total - f.size * first // total
        yield Piece("parquet", (f.path,), g, g + 1, first_row=first, weight=weight)
        first += rows


def _arrow_table(path: str):
    import pyarrow as pa

    # memory-mapped, zero-copy: a row range reads only its own pages (the buffers keep the map open)
    return pa.ipc.open_stream(pa.memory_map(path)).read_all()


def _arrow_pieces(f: InputFile, piece_bytes: int) -> Iterator[Piece]:
    rows = _arrow_table(f.path).num_rows
    step = max(1, rows * piece_bytes // max(1, f.size))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        weight = f.size * stop // rows - f.size * start // rows
        yield Piece("arrow", (f.path,), start, stop, first_row=start, weight=weight)


def read_documents(piece: Piece, text_key: str) -> list[str]:
    """The documents of one piece, in order. Raises InputError naming the file and line/row of a bad record."""
    if piece.kind == "text":
        return [_read_text(p) for p in piece.paths]
    if piece.kind == "jsonl":
        return _read_jsonl(piece, text_key)
    return _read_columnar(piece, text_key)


def _read_text(path: str) -> str:
    try:
        data = gzip.open(path, "rb").read() if path.lower().endswith(".gz") else Path(path).read_bytes()
    except (OSError, EOFError) as e:
        raise InputError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from e
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(
            f"{path}: not UTF-8 text (byte {e.start}); convert it to UTF-8, or give it a .jsonl/.parquet suffix "
            "if that is what it is"
        ) from e


def _piece_lines(piece: Piece) -> list[bytes]:
    if piece.lines is not None:
        return list(piece.lines)
    try:
        with open(piece.paths[0], "rb") as fh:
            fh.seek(piece.start)
            return fh.read(piece.stop - piece.start).splitlines()
    except OSError as e:
        raise InputError(f"{piece.paths[0]}: cannot read ({e.strerror})") from e


def where(piece: Piece, position: int) -> str:
    """ "FILE: line N" or "FILE: row index N (from 0)" of the record at `position` of a piece (read_records)."""
    path = piece.paths[0]
    if piece.kind != "jsonl":
        return f"{path}: row index {piece.first_row + position} (from 0)"
    # the line number is only worked out on error paths (counting the newlines before the piece)
    number = _lines_before(path, piece.start) + position + 1 if piece.lines is None else piece.first_row + position + 1
    return f"{path}: line {number}"


def _read_jsonl(piece: Piece, text_key: str) -> list[str]:
    docs = []
    for i, line in enumerate(_piece_lines(piece)):
        if not line.strip():
            continue
        try:
            docs.append(_json_text(line, text_key))
        except _BadRecord as e:
            raise InputError(f"{where(piece, i)}: {e}") from None
    return docs


def read_records(piece: Piece, keys: tuple[str, ...], hint: str) -> list[tuple[int, list]]:
    """The records of a JSON Lines or columnar piece as (position, the values of `keys`), in order; `where(piece,
    position)` names one in a message. A record without a key is an InputError naming the file, the line or row
    and `hint` (the option that sets the key)."""
    if piece.kind == "text":
        raise InputError(
            f"{piece.paths[0]}: a plain-text file; this format reads records (JSON Lines, Parquet or a saved "
            "dataset), or pass --format text"
        )
    if piece.kind == "jsonl":
        out = []
        for i, line in enumerate(_piece_lines(piece)):
            if not line.strip():
                continue
            try:
                out.append((i, _json_values(line, keys, hint)))
            except _BadRecord as e:
                raise InputError(f"{where(piece, i)}: {e}") from None
        return out
    columns = [_column(piece, key).to_pylist() for key in keys]
    rows = []
    for i, values in enumerate(zip(*columns)):
        missing = [k for k, v in zip(keys, values) if v is None]
        if missing:
            raise InputError(f"{where(piece, i)}: {missing[0]!r} is null; {hint}")
        rows.append((i, list(values)))
    return rows


def _json_values(line: bytes, keys: tuple[str, ...], hint: str) -> list:
    try:
        record = json.loads(line)
    except ValueError as e:
        raise _BadRecord(f"bad JSON ({_one_line(e)})") from None
    if not isinstance(record, dict):
        raise _BadRecord(f"a JSON {type(record).__name__}, not an object with {', '.join(map(repr, keys))}")
    for key in keys:
        if record.get(key) is None:
            found = ", ".join(list(record)[:8]) or "none"
            raise _BadRecord(f"no {key!r} key (keys: {found}); {hint}")
    return [record[key] for key in keys]


def _lines_before(path: str, offset: int) -> int:
    count = 0
    with open(path, "rb") as fh:
        while offset > 0:
            block = fh.read(min(offset, 1 << 22))
            if not block:
                break
            count += block.count(b"\n")
            offset -= len(block)
    return count


class _BadRecord(ValueError):
    """What is wrong with one JSON line; the caller adds the file and line number."""


def _json_text(line: bytes, text_key: str) -> str:
    try:
        record = json.loads(line)
    except ValueError as e:
        raise _BadRecord(f"bad JSON ({_one_line(e)})") from None
    if not isinstance(record, dict):
        raise _BadRecord(f"a JSON {type(record).__name__}, not an object with a {text_key!r} key")
    if text_key not in record:
        keys = ", ".join(list(record)[:8]) or "none"
        raise _BadRecord(f"no {text_key!r} key (keys: {keys}); pass --text-key with the key of the text")
    text = record[text_key]
    if not isinstance(text, str):
        raise _BadRecord(f"{text_key!r} is {type(text).__name__}, not a string")
    return text


def _column(piece: Piece, key: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = piece.paths[0]
    try:
        if piece.kind == "parquet":
            return pq.ParquetFile(path).read_row_group(piece.start, columns=[key]).column(key)
        return _arrow_table(path).slice(piece.start, piece.stop - piece.start).column(key)
    except (OSError, KeyError, pa.ArrowException) as e:
        raise InputError(f"{path}: cannot read column {key!r} ({_one_line(e)})") from e


def _read_columnar(piece: Piece, text_key: str) -> list[str]:
    import pyarrow as pa

    path = piece.paths[0]
    column = _column(piece, text_key)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise InputError(f"{path}: column {text_key!r} holds {column.type}, not strings; pass --text-key")
    if column.null_count:
        row = piece.first_row + column.is_null().to_pylist().index(True)
        raise InputError(f"{path}: row index {row} (from 0): {text_key!r} is null, not a string")
    return column.to_pylist()
