"""Diffusion denoisers from diffusers' own model classes: a UNet2DModel or a DiTTransformer2DModel, chosen by
`model.diffusers = FOLDER` (a pipeline folder as diffusers writes it: model_index.json, unet/ or transformer/, and
scheduler/; or one model folder holding its config.json) or by a preset (`model.name = "unet-tiny-diffusion"`),
whose config fields and the DDPM scheduler's (num_train_timesteps, beta_schedule, prediction_type, ...) are `[model]`
keys. The diffusion task (tasks/diffusion.py) trains it to predict the noise its scheduler added; `ckpt export
--format diffusers` writes a folder `DiffusionPipeline.from_pretrained` loads."""

from scaletrain.models.diffusion.args import PRESETS, DiffusionArgs
from scaletrain.models.diffusion.spec import DiffusionSpec

SPEC = DiffusionSpec

__all__ = ["PRESETS", "SPEC", "DiffusionArgs", "DiffusionSpec"]
