"""image-classification: one label per image, the task of ViTs, ResNets and ConvNeXts trained from scratch or
fine-tuned.

Batch: data.image_loader.ImageBatch, (B, C, H, W) float32 pixels decoded and augmented in the loader's workers
(data/images.py) and (B,) int64 labels, from a folder `scaletrain data prepare --format images` wrote (data.path).
Loss: summed cross-entropy of the logits in fp32. Count: images (every label is trained), so throughput is reported
as images_per_s and a step's normaliser is fixed by the config. Evaluation: mean loss and accuracy (the share of
images whose largest logit is their label) over the validation split. The model's head gets the data's classes
unless model.num_labels (or a folder's trained head) fixes them (`bind_data`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field

from scaletrain.tasks.base import Task

if TYPE_CHECKING:
    import torch

    from scaletrain.config.schema import JobConfig
    from scaletrain.data.image_loader import ImageBatch
    from scaletrain.models.spec import ModelSpec


@dataclass(frozen=True)
class Options:
    image_size: Annotated[int, Field(ge=0, le=8192)] = 0  # side of the square input in pixels; 0: the model's
    channels: Annotated[int, Field(ge=0, le=4)] = 0  # 1 (grey) or 3 (RGB); 0: the model's (3 if it does not say)
    augment: bool = True  # random crop from reflection padding and horizontal flip, training split only
    decode_workers: Annotated[int, Field(gt=0, le=64)] = 2  # threads decoding a rank's images


class ImageClassification(Task):
    name = "image-classification"
    options_type = Options
    unit = "images"
    sequences = False  # (B, C, H, W) pixels: nothing for context parallelism to split

    options: Options

    def _image_size(self, spec: ModelSpec) -> int:
        size = self.options.image_size or getattr(spec, "image_size", None)
        if not size:
            raise ValueError(f"task.image_size: the {spec.family} model takes images of any size; set "
                             f"task.image_size=PIXELS")  # fmt: skip
        return int(size)

    def _channels(self, spec: ModelSpec) -> int:
        return self.options.channels or int(getattr(spec, "num_channels", 3))

    def check(self, cfg: JobConfig, spec: ModelSpec) -> None:
        """The model classifies images (a head of classes, no vocabulary); layouts and data this task reads."""
        if spec.vocab_size is not None or not hasattr(spec, "num_labels"):
            raise ValueError(f"task.name: {self.name} feeds images, and the {spec.family} model is not an image "
                             f"classifier; use a vision model (model.hf = a vision folder, a preset such as "
                             f"vit-tiny-image, or model.factory)")  # fmt: skip
        size = self._image_size(spec)
        fixed = getattr(spec, "image_size", None)
        if getattr(spec, "fixed_image_size", False) and fixed and size != fixed:
            raise ValueError(f"task.image_size: {size} does not match the model's image_size {fixed} (its position "
                             f"embeddings fix it); set task.image_size={fixed} or change model.image_size")  # fmt: skip
        if self._channels(spec) not in (1, 3):
            raise ValueError(f"task.channels: images are decoded as 1 (grey) or 3 (RGB) channels, the model takes "
                             f"{self._channels(spec)}; set task.channels")  # fmt: skip
        self.refuse_degrees(cfg, "pp", "cp")
        if cfg.parallel.tp > 1 and cfg.parallel.sequence_parallel:
            raise ValueError(f"parallel.sequence_parallel: {self.name} does not split images' patches over tensor-"
                             f"parallel ranks yet; set parallel.sequence_parallel=false")  # fmt: skip
        self.require_prepared(cfg, "image", "images")

    def check_data(self, cfg: JobConfig, spec: ModelSpec) -> None:
        """The folder is a prepared image dataset with training and validation images, whose classes the model's
        head (when fixed) covers."""
        from scaletrain.data.images import read_manifest

        assert cfg.data.path is not None  # check() refused a job without it
        manifest = read_manifest(cfg.data.path)
        for split in ("train", "val"):
            if not manifest.splits.get(split, {}).get("samples"):
                raise ValueError(f"data.path: {cfg.data.path} has no {split} images; prepare it again "
                                 f"(--val-share > 0 keeps some for validation)")  # fmt: skip
        labels = int(getattr(spec, "num_labels", 0))
        if getattr(spec, "labels_given", False) and labels and manifest.num_labels > labels:
            raise ValueError(f"model.num_labels: the data has {manifest.num_labels} classes, the model's head "
                             f"{labels}; raise model.num_labels or leave it unset to take the data's")  # fmt: skip

    def bind_data(self, cfg: JobConfig, spec: ModelSpec) -> ModelSpec:
        """A head of the data's classes (named after them) unless the model fixes its own."""
        from scaletrain.data.images import read_manifest

        if getattr(spec, "labels_given", True) or not hasattr(spec, "with_labels"):
            return spec
        assert cfg.data.path is not None
        return spec.with_labels(read_manifest(cfg.data.path).classes)

    def loaders(self, cfg: JobConfig, spec: ModelSpec, micro_batch: int, dp_rank: int, dp_size: int) -> tuple:
        from scaletrain.data.image_loader import ImageLoader
        from scaletrain.data.images import ImageShards, Pixels
        from scaletrain.data.sources import cache_folder

        assert cfg.data.path is not None
        size, channels = self._image_size(spec), self._channels(spec)
        gb, seed, workers = cfg.train.global_batch_size, cfg.run.seed, self.options.decode_workers
        train = ImageShards(cfg.data.path, "train", cache_folder(Path(cfg.data.path), cfg.data.cache_dir))
        val = ImageShards(cfg.data.path, "val")
        return (
            ImageLoader(train, Pixels(size, channels, self.options.augment), gb, micro_batch, dp_rank, dp_size, seed,
                        workers=workers, prefetch=cfg.data.prefetch),
            ImageLoader(val, Pixels(size, channels, augment=False), gb, micro_batch, dp_rank, dp_size, seed,
                        shuffle=False, workers=workers),
        )  # fmt: skip

    def inputs(self, batch: ImageBatch) -> torch.Tensor:
        return batch.pixels

    def targets(self, batch: ImageBatch) -> torch.Tensor:
        return batch.labels

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of logits (B, classes) against labels (B,), in fp32."""
        import torch.nn.functional as F

        return F.cross_entropy(outputs.float(), targets, reduction="sum")

    def count(self, batch: ImageBatch) -> int:
        return int(batch.labels.numel())

    def flops_per_unit(self, cfg: JobConfig, spec: ModelSpec) -> float | None:
        per_image = getattr(spec, "flops_per_image", None)
        return per_image() if callable(per_image) else None

    def eval_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Correct predictions (argmax of the logits equals the label), summed."""
        return {"correct": (outputs.argmax(dim=-1) == targets).sum()}

    def eval_metrics(self, loss_sum: float, count: float, sums: dict[str, float] | None = None) -> dict[str, Any]:
        metrics = {"val_loss": loss_sum / count}
        if sums is not None:
            metrics["val_accuracy"] = sums["correct"] / count
        return metrics


TASK = ImageClassification
