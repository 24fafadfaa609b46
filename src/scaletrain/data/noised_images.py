"""The image loader of the diffusion task: each image with the noise of its diffusion step added, drawn so that a
sample's noise depends on nothing but the run's seed and the sample's position in the stream.

The forward process is the model's own scheduler's (diffusers' DDPMScheduler.add_noise, in fp32 on the host): the
sample at stream position p gets a timestep t ~ U{0..T-1} and Gaussian noise drawn from a torch generator seeded by
(seed, p), so one process, any data-parallel layout, any accumulation and a resumed run give every image the same
noise and timestep, which makes their losses equal and resume bit-identical. Drawing runs where decoding runs
(prefetched with it): it is a pure function of the position, like the augmentation.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from scaletrain.data.image_loader import ImageBatch, ImageLoader


@dataclass
class NoisedBatch:
    noisy: torch.Tensor  # (b, C, H, W) float32: the images with their step's noise, x_t
    timesteps: torch.Tensor  # (b,) int64 in [0, num_train_timesteps)
    labels: torch.Tensor | None  # (b,) int64 classes for a class-conditional model; None otherwise
    target: torch.Tensor  # (b, C, H, W) float32: what the model predicts (the noise, the velocity or the image)


def noise_seed(seed: int, position: int) -> int:
    """The generator seed of the sample at stream `position` (a 63-bit hash of both: no two pairs share a stream)."""
    digest = hashlib.blake2b(f"diffusion-noise:{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class NoisedImageLoader(ImageLoader):
    """ImageLoader whose micro-batches are NoisedBatch: pixels in [-1, 1] (data/images.py's normalisation), noised
    by `scheduler` (diffusers' DDPMScheduler) at a timestep drawn per sample."""

    def __init__(self, *args: Any, scheduler: Any, conditional: bool, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.scheduler, self.conditional = scheduler, conditional
        self.num_train_timesteps = int(scheduler.config.num_train_timesteps)
        self.prediction_type = str(scheduler.config.prediction_type)

    def noised(self, batch: ImageBatch, first_position: int) -> NoisedBatch:
        """`batch` (its images at stream positions first_position, first_position + 1, ...) noised."""
        clean = batch.pixels
        steps, noises = [], []
        for i in range(clean.shape[0]):
            gen = torch.Generator().manual_seed(noise_seed(self.seed, first_position + i))
            steps.append(torch.randint(0, self.num_train_timesteps, (1,), generator=gen))
            noises.append(torch.randn(clean.shape[1:], generator=gen))
        timesteps, noise = torch.cat(steps), torch.stack(noises)
        noisy = self.scheduler.add_noise(clean, noise, timesteps)
        if self.prediction_type == "v_prediction":
            target = self.scheduler.get_velocity(clean, noise, timesteps)
        elif self.prediction_type == "sample":
            target = clean
        else:  # epsilon
            target = noise
        return NoisedBatch(noisy, timesteps, batch.labels if self.conditional else None, target)

    def _step_at(self, position: int) -> list[NoisedBatch]:  # type: ignore[override]
        start = position + self.dp_rank * (self.global_batch // self.dp_size)
        return [self.noised(b, start + i * self.micro_batch) for i, b in enumerate(super()._step_at(position))]
