"""`scaletrain data prepare --format images`: class-per-folder image trees, or JSON Lines of {"path", "label"}, into
WebDataset-style tar shards with an index and a manifest (layout: data/images.py).

Inputs: a folder whose sub-folders are the classes (ImageNet's and torchvision's ImageFolder layout: sorted folder
names are labels 0..N-1), or a .jsonl file of records {"path": IMAGE, "label": NAME or INDEX} (paths relative to
the file's folder). Every image is opened and verified with Pillow before anything is written: an unreadable one
stops the prepare naming its path (exit 2), or with skip_bad is left out and counted in the manifest. An empty class
folder stops it too. The image bytes are stored as given (no re-encoding): what a user's other tools read is the
original file. A sample goes to the validation split by a hash of its index (val_share of them), the same on every
run.
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

from scaletrain.data.images import MANIFEST, ImageManifest

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm")


class ImagePrepareError(ValueError):
    """What the user gave cannot be prepared; one line naming the path and the fix (exit 2)."""


@dataclass(frozen=True)
class ImageSample:
    path: Path
    label: int


@dataclass(frozen=True)
class ImagePrepareOptions:
    val_share: float = 0.01
    shard_images: int = 10_000  # samples per tar shard
    skip_bad: bool = False  # leave unreadable images out (counted in the manifest) instead of stopping


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
        self._rows: list[tuple[int, int, int]] = []

    def add(self, key: int, suffix: str, data: bytes, label: int) -> None:
        if self._tar is None:
            name = f"{self.split}-{len(self.shards):05d}.tar"
            self._tar = tarfile.open(self.out / name, "w", format=tarfile.USTAR_FORMAT)
            self._rows = []
        image = tarfile.TarInfo(f"{key:09d}{suffix.lower()}")
        image.size = len(data)
        header = image.tobuf(tarfile.USTAR_FORMAT, self._tar.encoding, self._tar.errors)
        self._rows.append((self._tar.offset + len(header), len(data), label))  # the data follows its header
        self._tar.addfile(image, io.BytesIO(data))
        text = str(label).encode()
        cls = tarfile.TarInfo(f"{key:09d}.cls")
        cls.size = len(text)
        self._tar.addfile(cls, io.BytesIO(text))
        self.samples += 1
        if len(self._rows) >= self.per_shard:
            self.close()

    def close(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        tar = Path(self._tar.name)  # type: ignore[arg-type]
        index = tar.with_name(tar.name.removesuffix(".tar") + ".idx.npy")
        np.save(index, np.array(self._rows, dtype=np.int64).reshape(-1, 3))
        self.shards.append({"tar": tar.name, "index": index.name, "samples": len(self._rows),
                            "bytes": tar.stat().st_size})  # fmt: skip
        self._tar = None

    def split_entry(self) -> dict:
        return {"samples": self.samples, "shards": self.shards}


def prepare_images(inputs: list[Path], out: Path, options: ImagePrepareOptions) -> ImageManifest:
    """Check each image and write it into the shards of its split (one image in memory at a time), then write
    manifest.json last; returns the manifest."""
    classes, samples = collect(inputs)
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
        writers[split].add(key, sample.path.suffix, data, sample.label)
    for writer in writers.values():
        writer.close()
    manifest = ImageManifest(classes, {s: w.split_entry() for s, w in writers.items()}, skipped)
    tmp = out / f".{MANIFEST}.tmp-{os.getpid()}"
    tmp.write_text(manifest.to_json())
    os.replace(tmp, out / MANIFEST)
    return manifest
