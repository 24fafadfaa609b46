"""Prepared image datasets: WebDataset-style tar shards that a user's other tools read as they are, plus an index.

Layout of a prepared folder (`scaletrain data prepare --format images`, data/image_prepare.py):

    manifest.json            {"format": "images", "classes": [...], "num_labels": N, "splits": {"train": ..., "val": ...}}
    train-00000.tar          members KEY.png|jpg|... (the image's bytes as given) and KEY.cls (its label, decimal)
    train-00000.idx.npy      int64 (samples, 3): the image member's data offset in the tar, its size, its label

An image-text folder (`--format image-text`, for vision-language models) is the same with format "image-text", no
classes (label -1), and a third member per sample, KEY.json (the row's caption or chat messages, UTF-8 JSON), whose
offset and size are the index's columns 3 and 4.

WebDataset (`webdataset.WebDataset("train-{00000..00009}.tar")`), `tar tf` and any tar reader see a sample as the
members sharing a KEY; the index lets scaletrain read any sample with one positioned read (os.pread on a descriptor
opened once), so the loader reads samples in any order with memory flat in the dataset's size (the index and the
epoch's order are memory-mapped).

Decoding (Pillow) and augmentation (numpy + torch) run in the loader's worker threads (Pillow releases the GIL while
it decodes); augmentation draws from a generator seeded by (seed, the sample's position in the stream), so a
resumed run sees the same pixels as an uninterrupted one.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from scaletrain.data.order import cached_permutation

FORMAT = "images"
IMAGE_TEXT = "image-text"  # the format of image-caption / image-chat folders (same shards, a KEY.json member more)
MANIFEST = "manifest.json"
MEAN, STD = 0.5, 0.5  # pixels in [0, 1] are fed as (x - MEAN) / STD, transformers' ViT image processor's default
CROP_PAD = 4  # pixels of reflection padding before the random crop (the CIFAR recipe)


class ImageDataError(ValueError):
    """A prepared image folder cannot be read; the message is one line naming the path."""


@dataclass
class ImageManifest:
    classes: list[str]
    splits: dict[str, dict]  # split -> {"samples": n, "shards": [{"tar", "index", "samples", "bytes"}]}
    skipped: int = 0  # unreadable images left out by --skip-bad-images
    format: str = FORMAT  # "images" or "image-text"

    @property
    def num_labels(self) -> int:
        return len(self.classes)

    def to_json(self) -> str:
        body = {"format": self.format, "version": 1, "classes": self.classes, "num_labels": self.num_labels,
                "splits": self.splits, "skipped_images": self.skipped}  # fmt: skip
        return json.dumps(body, indent=1) + "\n"


def is_image_folder(path: str | Path) -> bool:
    """Whether `path` is a prepared image dataset (its manifest says format "images")."""
    try:
        return json.loads((Path(path) / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def read_manifest(folder: str | Path, field: str = "data.path", fmt: str = FORMAT) -> ImageManifest:
    """The manifest of a prepared image folder of format `fmt`; ImageDataError (one line naming `field`) when it is
    not one."""
    path = Path(folder) / MANIFEST
    try:
        body = json.loads(path.read_text())
    except OSError:
        raise ImageDataError(f"{field}: {folder} has no {MANIFEST}; prepare it with "
                             f"`scaletrain data prepare --format {fmt}`") from None  # fmt: skip
    except ValueError as e:
        raise ImageDataError(f"{field}: {path} is not valid JSON ({e})") from None
    if not isinstance(body, dict) or body.get("format") != fmt:
        what = "an image" if fmt == FORMAT else f"an {fmt}"
        raise ImageDataError(f"{field}: {folder} is not {what} dataset (its manifest's format is "
                             f"{body.get('format', 'tokens') if isinstance(body, dict) else '?'!r}); prepare it "
                             f"with --format {fmt}")  # fmt: skip
    return ImageManifest(list(body["classes"]), dict(body["splits"]), int(body.get("skipped_images", 0)), fmt)


class ImageShards:
    """One split of a prepared image folder: sample i's encoded bytes and label, read with one pread each."""

    def __init__(self, folder: str | Path, split: str, cache_dir: Path | None = None, fmt: str = FORMAT):
        self.folder = Path(folder)
        manifest = read_manifest(folder, fmt=fmt)
        self.classes = manifest.classes
        shards = manifest.splits.get(split, {"samples": 0, "shards": []})["shards"]
        self.num_samples = sum(int(s["samples"]) for s in shards)
        self.ends = np.cumsum([int(s["samples"]) for s in shards], dtype=np.int64)
        self.indexes = [np.load(self.folder / s["index"], mmap_mode="r") for s in shards]
        self.tars = [self.folder / s["tar"] for s in shards]
        self.cache_dir = cache_dir
        self._fds: dict[int, int] = {}

    def _fd(self, shard: int) -> int:
        fd = self._fds.get(shard)
        if fd is None:  # a race opens it twice: harmless, one descriptor stays
            fd = self._fds[shard] = os.open(self.tars[shard], os.O_RDONLY)
        return fd

    def _row(self, i: int) -> tuple[int, np.ndarray]:
        shard = int(np.searchsorted(self.ends, i, side="right"))
        return shard, self.indexes[shard][i - (int(self.ends[shard - 1]) if shard else 0)]

    def read(self, i: int) -> tuple[bytes, int]:
        """(encoded image bytes, label) of sample i."""
        shard, row = self._row(i)
        offset, size, label = int(row[0]), int(row[1]), int(row[2])
        return os.pread(self._fd(shard), size, offset), label

    def read_text(self, i: int) -> dict:
        """The text record (KEY.json: {"caption": ...} or {"messages": [...]}) of sample i of an image-text
        folder."""
        shard, row = self._row(i)
        return json.loads(os.pread(self._fd(shard), int(row[4]), int(row[3])))

    def labels(self) -> np.ndarray:
        """Every sample's label (int64), in order."""
        if not self.indexes:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.asarray(ix[:, 2]) for ix in self.indexes])

    def order(self, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
        if not shuffle:
            return np.arange(self.num_samples, dtype=np.int64)
        return cached_permutation(self.cache_dir, self.num_samples, seed, epoch)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@dataclass(frozen=True)
class Pixels:
    """How encoded images become the model's input: a square of `size` pixels with `channels` channels (1: grey,
    3: RGB), flipped and cropped at random (from reflection padding) when `augment`."""

    size: int
    channels: int = 3
    augment: bool = True

    def decode(self, data: bytes, seed: int, position: int) -> torch.Tensor:
        """(channels, size, size) float32, normalised; random choices drawn from (seed, position)."""
        from PIL import Image

        with Image.open(io.BytesIO(data)) as encoded:
            image = encoded.convert("L" if self.channels == 1 else "RGB")
        if image.size != (self.size, self.size):
            image = image.resize((self.size, self.size), Image.Resampling.BILINEAR)
        array = np.asarray(image, dtype=np.uint8)
        if array.ndim == 2:
            array = array[:, :, None]
        if self.augment:
            rng = np.random.default_rng([seed, position])
            padded = np.pad(array, ((CROP_PAD, CROP_PAD), (CROP_PAD, CROP_PAD), (0, 0)), mode="reflect")
            top, left = rng.integers(0, 2 * CROP_PAD + 1, size=2)
            array = padded[top : top + self.size, left : left + self.size]
            if rng.random() < 0.5:
                array = array[:, ::-1]
        pixels = torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1))).float().div_(255.0)
        return pixels.sub_(MEAN).div_(STD)
