"""`scaletrain data prepare --format images`: class-per-folder image trees, or JSON Lines of {"path", "label"}, into
WebDataset-style tar shards with an index and a manifest (layout: data/images.py).

Inputs: a folder whose sub-folders are the classes (ImageNet's and torchvision's ImageFolder layout: sorted folder
names are labels 0..N-1), or a .jsonl file of records {"path": IMAGE, "label": NAME or INDEX} (paths relative to
the file's folder). Every image is opened and verified with Pillow before anything is written: an unreadable one
stops the prepare naming its path (exit 2), or with skip_bad is left out and counted in the manifest. An empty class
folder stops it too. The image bytes are stored as given (no re-encoding): what a user's other tools read is the
original file. A sample goes to the validation split by a hash of its index (val_share of them), the same on every
run.

`--format image-text` (vision-language models): JSON Lines or Parquet rows, each naming its image (`image_key`,
a path relative to the file's folder) and its text: a caption (`text_key`) or a chat-style messages list
(`messages_key`, the turns as transformers' chat templates take them, the image a {"type": "image"} content item).
The same shards, with the row's text as a KEY.json member beside the image (data/images.py); no classes. A row
without its image key or without any text stops the prepare naming the file and row (exit 2).
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scaletrain.data.images import FORMAT, IMAGE_TEXT, MANIFEST, ImageManifest

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm")


class ImagePrepareError(ValueError):
    """What the user gave cannot be prepared; one line naming the path and the fix (exit 2)."""


@dataclass(frozen=True)
class ImageSample:
    path: Path
    label: int
    text: bytes | None = None  # an image-text row's {"caption"} or {"messages"}, UTF-8 JSON


@dataclass(frozen=True)
class ImagePrepareOptions:
    val_share: float = 0.01
    shard_images: int = 10_000  # samples per tar shard
    skip_bad: bool = False  # leave unreadable images out (counted in the manifest) instead of stopping
    image_key: str = "image"  # image-text rows: the image path's key
    text_key: str = "caption"  # image-text rows: the caption's key
    messages_key: str = "messages"  # image-text rows: the chat messages' key (used when the caption's is absent)


def _from_tree(root: Path) -> tuple[list[str], list[ImageSample]]:
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise ImagePrepareError(f"{root}: no class folders; give one sub-folder of images per class")
    samples = []
    for label, name in enumerate(classes):
        files = sorted(p for p in (root / name).rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise ImagePrepareError(f"{root / name}: empty class folder (no {', '.join(IMAGE_SUFFIXES)} files); "
                                    f"add images or remove the folder")  # fmt: skip
        samples += [ImageSample(f, label) for f in files]
    return classes, samples


def _from_jsonl(path: Path) -> tuple[list[str], list[ImageSample]]:
    records = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                records.append((Path(record["path"]), record["label"]))
            except (ValueError, KeyError, TypeError):
                raise ImagePrepareError(f'{path}:{n}: not a JSON record with "path" and "label"') from None
    labels = [label for _, label in records]
    if all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in labels):
        classes = [str(i) for i in range(max(labels, default=-1) + 1)]
        index: dict[int | str, int] = {i: i for i in range(len(classes))}
    elif all(isinstance(x, str) for x in labels):
        classes = sorted(set(labels))
        index = {name: i for i, name in enumerate(classes)}
    else:
        raise ImagePrepareError(f"{path}: labels must be all class names (strings) or all indices (ints >= 0)")
    return classes, [ImageSample(p if p.is_absolute() else path.parent / p, index[x]) for p, x in records]


def collect(inputs: list[Path]) -> tuple[list[str], list[ImageSample]]:
    """(class names, samples) of one class-per-folder tree or one .jsonl file."""
    if len(inputs) != 1:
        raise ImagePrepareError("INPUT: --format images takes one class-per-folder tree or one .jsonl file")
    source = inputs[0]
    if source.is_dir():
        classes, samples = _from_tree(source)
    elif source.is_file() and source.suffix == ".jsonl":
        classes, samples = _from_jsonl(source)
    else:
        raise ImagePrepareError(f"{source}: give a folder of class folders or a .jsonl of path/label records")
    if not samples:
        raise ImagePrepareError(f"{source}: no images found")
    return classes, samples


def _readable(path: Path) -> bytes | None:
    """The file's bytes when Pillow can decode it, else None."""
    from PIL import Image, UnidentifiedImageError

    try:
        data = path.read_bytes()
        with Image.open(io.BytesIO(data)) as image:
            image.load()  # decodes the pixels: a truncated file fails here, not in training
        return data
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError):
        return None


def _is_val(index: int, val_share: float) -> bool:
    return zlib.crc32(index.to_bytes(8, "little")) / 2**32 < val_share


class _ShardWriter:
    """Tar shards of one split, each with its index array (data offset, size, label per sample)."""

    def __init__(self, out: Path, split: str, per_shard: int):
        self.out, self.split, self.per_shard = out, split, per_shard
        self.shards: list[dict] = []
        self.samples = 0
        self._tar: tarfile.TarFile | None = None
        self._rows: list[tuple[int, ...]] = []

    def _member(self, name: str, data: bytes) -> tuple[int, int]:
        """Add a member; (its data's offset in the tar, its size)."""
        assert self._tar is not None
        info = tarfile.TarInfo(name)
        info.size = len(data)
        header = info.tobuf(tarfile.USTAR_FORMAT, self._tar.encoding, self._tar.errors)
        offset = self._tar.offset + len(header)  # the data follows its header
        self._tar.addfile(info, io.BytesIO(data))
        return offset, len(data)

    def add(self, key: int, suffix: str, data: bytes, label: int, text: bytes | None = None) -> None:
        if self._tar is None:
            name = f"{self.split}-{len(self.shards):05d}.tar"
            self._tar = tarfile.open(self.out / name, "w", format=tarfile.USTAR_FORMAT)
            self._rows = []
        image = self._member(f"{key:09d}{suffix.lower()}", data)
        if text is None:
            self._member(f"{key:09d}.cls", str(label).encode())
            self._rows.append((*image, label))
        else:
            self._rows.append((*image, label, *self._member(f"{key:09d}.json", text)))
        self.samples += 1
        if len(self._rows) >= self.per_shard:
            self.close()

    def close(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        tar = Path(self._tar.name)  # type: ignore[arg-type]
        index = tar.with_name(tar.name.removesuffix(".tar") + ".idx.npy")
        np.save(index, np.array(self._rows, dtype=np.int64).reshape(len(self._rows), -1))
        self.shards.append({"tar": tar.name, "index": index.name, "samples": len(self._rows),
                            "bytes": tar.stat().st_size})  # fmt: skip
        self._tar = None

    def split_entry(self) -> dict:
        return {"samples": self.samples, "shards": self.shards}


def prepare_images(inputs: list[Path], out: Path, options: ImagePrepareOptions) -> ImageManifest:
    """Check each image and write it into the shards of its split (one image in memory at a time), then write
    manifest.json last; returns the manifest."""
    classes, samples = collect(inputs)
    return _write(classes, samples, out, options, FORMAT)


def _write(
    classes: list[str], samples: list[ImageSample], out: Path, options: ImagePrepareOptions, fmt: str
) -> ImageManifest:
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # written last: an unfinished folder never looks complete
    writers = {split: _ShardWriter(out, split, options.shard_images) for split in ("train", "val")}
    skipped = 0
    for key, sample in enumerate(samples):
        data = _readable(sample.path)
        if data is None:
            if not options.skip_bad:
                raise ImagePrepareError(f"{sample.path}: not a readable image; fix or remove it, or pass "
                                        f"--skip-bad-images to leave such files out (counted in the manifest)")  # fmt: skip
            skipped += 1
            continue
        split = "val" if _is_val(key, options.val_share) else "train"
        writers[split].add(key, sample.path.suffix, data, sample.label, sample.text)
    for writer in writers.values():
        writer.close()
    manifest = ImageManifest(classes, {s: w.split_entry() for s, w in writers.items()}, skipped, fmt)
    tmp = out / f".{MANIFEST}.tmp-{os.getpid()}"
    tmp.write_text(manifest.to_json())
    os.replace(tmp, out / MANIFEST)
    return manifest


def _rows(path: Path) -> list[tuple[str, object]]:
    """(where, row) of a .jsonl or .parquet file: `where` is "FILE:LINE" or "FILE row N" for messages."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return [(f"{path} row {n}", row) for n, row in enumerate(pq.read_table(path).to_pylist(), 1)]
    rows: list[tuple[str, object]] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append((f"{path}:{n}", json.loads(line)))
            except ValueError:
                raise ImagePrepareError(f"{path}:{n}: not a JSON record") from None
    return rows


def collect_image_text(inputs: list[Path], options: ImagePrepareOptions) -> list[ImageSample]:
    """The samples of .jsonl / .parquet files of image-text rows (module docstring); ImagePrepareError (one line
    naming the file and row) for a row without its image or text."""
    samples = []
    for source in inputs:
        if not source.is_file() or source.suffix not in (".jsonl", ".parquet"):
            raise ImagePrepareError(f"{source}: --format image-text takes .jsonl or .parquet files of rows with "
                                    f"an image path and a caption or messages")  # fmt: skip
        for where, row in _rows(source):
            if not isinstance(row, dict) or not isinstance(row.get(options.image_key), str):
                raise ImagePrepareError(f"{where}: no {options.image_key!r} key (the image's path); give every row "
                                        f"its image, or name the key with --image-key")  # fmt: skip
            caption, messages = row.get(options.text_key), row.get(options.messages_key)
            if isinstance(caption, str) and caption:
                text: dict = {"caption": caption}
            elif isinstance(messages, list) and messages:
                text = {"messages": messages}
            else:
                raise ImagePrepareError(f"{where}: no {options.text_key!r} caption or {options.messages_key!r} list; "
                                        f"give every row its text (--text-key, --messages-key)")  # fmt: skip
            image = Path(row[options.image_key])
            samples.append(ImageSample(image if image.is_absolute() else source.parent / image, -1,
                                       json.dumps(text, ensure_ascii=False).encode()))  # fmt: skip
    if not samples:
        raise ImagePrepareError(f"{inputs[0] if inputs else 'INPUT'}: no image-text rows found")
    return samples


def prepare_image_text(inputs: list[Path], out: Path, options: ImagePrepareOptions) -> ImageManifest:
    """`--format image-text`: each row's image checked and written with its text into the shards of its split."""
    return _write([], collect_image_text(inputs, options), out, options, IMAGE_TEXT)
