"""diffusion: denoising diffusion training (DDPM, Ho et al. 2020) of a diffusers UNet2DModel or DiT, the task of
image generation models trained from scratch or fine-tuned.

Batch: data.noised_images.NoisedBatch from a folder `scaletrain data prepare --format images` wrote (data.path):
each image decoded to [-1, 1], a timestep t and Gaussian noise drawn for it from (seed, its stream position), and
the noised image x_t from the model's own scheduler (diffusers' DDPMScheduler.add_noise; num_train_timesteps,
beta_schedule and prediction_type from the model's scheduler config). The model takes (x_t, t) and, when it is
class-conditional, the image's class (its folder in the prepared tree). Loss: the mean squared error of the
prediction against the noise (epsilon; or the velocity, or the clean image, per prediction_type), averaged over an
image's pixels and summed over images, in fp32; the step divides by the images, so its loss is diffusers' training
scripts' F.mse_loss(pred, target) at any layout. Count: images (images_per_s). Evaluation: the same loss over the
validation split, whose noise is drawn from the same positions at every evaluation (comparable across steps).
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
    from scaletrain.data.noised_images import NoisedBatch
    from scaletrain.models.spec import ModelSpec


@dataclass(frozen=True)
class Options:
    class_conditional: bool = False  # condition an unconditional model on the data's classes (a class embedding)
    augment: bool = False  # random crop from reflection padding and horizontal flip, training split only
    decode_workers: Annotated[int, Field(gt=0, le=64)] = 2  # threads decoding (and noising) a rank's images


class Diffusion(Task):
    name = "diffusion"
    options_type = Options
    unit = "images"
    sequences = False  # (B, C, H, W) pixels: nothing for context parallelism to split

    options: Options

    def check(self, cfg: JobConfig, spec: ModelSpec) -> None:
        """The model is a denoiser with a noise scheduler (the diffusion family); layouts and data this task reads."""
        if not callable(getattr(spec, "scheduler", None)) or not hasattr(spec, "num_classes"):
            raise ValueError(f"task.name: {self.name} trains a denoiser, and the {spec.family} model is not one; use "
                             f"a diffusion model (model.diffusers = a diffusers folder, or a preset such as "
                             f"unet-tiny-diffusion)")  # fmt: skip
        channels, out = int(getattr(spec, "num_channels", 3)), int(getattr(spec, "out_channels", 3))
        if channels not in (1, 3):
            raise ValueError(f"model.in_channels: images are decoded as 1 (grey) or 3 (RGB) channels, the model "
                             f"takes {channels}; set model.in_channels")  # fmt: skip
        if out != channels:
            raise ValueError(f"model.out_channels: the model predicts {out} channels of a {channels}-channel image "
                             f"(a learned variance is not trained here); set model.out_channels={channels}")  # fmt: skip
        if not getattr(spec, "image_size", 0):
            raise ValueError("model.sample_size: the model's config gives no image size; set model.sample_size")
        self.refuse_degrees(cfg, "pp", "cp")
        self.require_prepared(cfg, "image", "images")

    def check_data(self, cfg: JobConfig, spec: ModelSpec) -> None:
        """The folder is a prepared image dataset with training and validation images, whose classes a
        class-conditional model's embedding covers."""
        from scaletrain.data.images import read_manifest

        assert cfg.data.path is not None  # check() refused a job without it
        manifest = read_manifest(cfg.data.path)
        for split in ("train", "val"):
            if not manifest.splits.get(split, {}).get("samples"):
                raise ValueError(f"data.path: {cfg.data.path} has no {split} images; prepare it again "
                                 f"(--val-share > 0 keeps some for validation)")  # fmt: skip
        classes = int(getattr(spec, "num_classes", 0))
        if classes and manifest.num_labels > classes:
            raise ValueError(f"model.diffusers: the model is conditioned on {classes} classes, the data has "
                             f"{manifest.num_labels}; use a model of as many classes or an unconditional one")  # fmt: skip

    def bind_data(self, cfg: JobConfig, spec: ModelSpec) -> ModelSpec:
        """With task.class_conditional, an unconditional model gets a class embedding of the data's classes."""
        from scaletrain.data.images import read_manifest

        denoiser: Any = spec  # the diffusion family's spec (check() refused any other)
        if not self.options.class_conditional or denoiser.num_classes:
            return spec
        assert cfg.data.path is not None
        return denoiser.with_classes(read_manifest(cfg.data.path).num_labels)

    def loaders(self, cfg: JobConfig, spec: ModelSpec, micro_batch: int, dp_rank: int, dp_size: int) -> tuple:
        from scaletrain.data.images import ImageShards, Pixels
        from scaletrain.data.noised_images import NoisedImageLoader
        from scaletrain.data.sources import cache_folder

        assert cfg.data.path is not None
        denoiser: Any = spec  # the diffusion family's spec (check() refused any other)
        size, channels, conditional = int(denoiser.image_size), int(denoiser.num_channels), bool(denoiser.num_classes)
        gb, seed, workers = cfg.train.global_batch_size, cfg.run.seed, self.options.decode_workers
        train = ImageShards(cfg.data.path, "train", cache_folder(Path(cfg.data.path), cfg.data.cache_dir))
        val = ImageShards(cfg.data.path, "val")
        return (
            NoisedImageLoader(train, Pixels(size, channels, self.options.augment), gb, micro_batch, dp_rank, dp_size,
                              seed, workers=workers, prefetch=cfg.data.prefetch,
                              scheduler=denoiser.scheduler(), conditional=conditional),
            NoisedImageLoader(val, Pixels(size, channels, augment=False), gb, micro_batch, dp_rank, dp_size, seed,
                              shuffle=False, workers=workers, scheduler=denoiser.scheduler(),
                              conditional=conditional),
        )  # fmt: skip

    def inputs(self, batch: NoisedBatch) -> tuple[torch.Tensor, ...]:
        """(x_t, t) or, for a class-conditional model, (x_t, t, classes): the positional arguments of diffusers'
        UNet2DModel and DiTTransformer2DModel forwards."""
        if batch.labels is None:
            return batch.noisy, batch.timesteps
        return batch.noisy, batch.timesteps, batch.labels

    def targets(self, batch: NoisedBatch) -> torch.Tensor:
        return batch.target

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per image, the mean squared error over its pixels (B, C, H, W), summed over images, in fp32."""
        return (outputs.float() - targets.float()).square().flatten(1).mean(dim=1).sum()

    def count(self, batch: NoisedBatch) -> int:
        return int(batch.timesteps.numel())


TASK = Diffusion
