"""What a diffusion spec is bound to: the diffusers class of its denoiser, that model's config and its noise
scheduler's config (canonical JSON text, so the args stay hashable and go into a checkpoint manifest whole), and
the folder its weights come from. No torch."""

from __future__ import annotations

import json
from dataclasses import dataclass

# diffusers' denoiser classes this family builds -> the pipeline folder's component holding it
MODEL_FOLDERS = {"UNet2DModel": "unet", "DiTTransformer2DModel": "transformer"}
# the scheduler's `[model]` keys (DDPMScheduler's training-side config) and their defaults (diffusers 0.42)
SCHEDULER_DEFAULTS = {"num_train_timesteps": 1000, "beta_start": 0.0001, "beta_end": 0.02, "beta_schedule": "linear",
                      "prediction_type": "epsilon"}  # fmt: skip


@dataclass(frozen=True)
class DiffusionArgs:
    model_class: str  # a key of MODEL_FOLDERS
    config: str  # the model's config.json without diffusers' bookkeeping (keys starting with "_"), canonical JSON
    scheduler: str = "{}"  # the scheduler's config (with its "_class_name" when a folder gave one), canonical JSON
    path: str = ""  # the model's folder holding its weights ("" for a preset or a folder without weights)

    @property
    def config_dict(self) -> dict:
        return json.loads(self.config)

    @property
    def scheduler_dict(self) -> dict:
        return {**SCHEDULER_DEFAULTS, **json.loads(self.scheduler)}


def _args(model_class: str, **config) -> DiffusionArgs:
    return DiffusionArgs(model_class=model_class, config=json.dumps(config, sort_keys=True))


# tiny shapes for tests and first runs on a CPU; any field of the diffusers config is a `[model]` key
PRESETS = {
    "unet-tiny-diffusion": _args("UNet2DModel", sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                                 block_out_channels=[16, 32], down_block_types=["DownBlock2D", "AttnDownBlock2D"],
                                 up_block_types=["AttnUpBlock2D", "UpBlock2D"], norm_num_groups=8,
                                 attention_head_dim=8),
    "dit-tiny-diffusion": _args("DiTTransformer2DModel", sample_size=16, in_channels=3, out_channels=3, patch_size=4,
                                num_layers=2, num_attention_heads=2, attention_head_dim=16, num_embeds_ada_norm=1000),
}  # fmt: skip
