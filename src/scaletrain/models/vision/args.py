"""What a vision spec is bound to: a transformers vision config (as canonical JSON text, so the args stay hashable
and go into a checkpoint manifest whole), the folder it came from, and the number of classes. No torch."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class VisionArgs:
    config: str  # config.json's text, canonical JSON (sorted keys)
    path: str = ""  # the folder the config came from ("" for a preset or a checkpoint manifest)
    num_labels: int = 0  # classes of the head; 0: taken from the data (the image-classification task)

    @property
    def config_dict(self) -> dict:
        return json.loads(self.config)


def _args(**config) -> VisionArgs:
    return VisionArgs(config=json.dumps(config, sort_keys=True))


# tiny shapes for tests and first runs on a CPU; any field of the transformers config is a `[model]` key
PRESETS = {
    "vit-tiny-image": _args(model_type="vit", image_size=32, patch_size=8, num_channels=3, hidden_size=32,
                            num_hidden_layers=2, num_attention_heads=2, intermediate_size=64),
    "resnet-tiny-image": _args(model_type="resnet", num_channels=3, embedding_size=16, hidden_sizes=[16, 32],
                               depths=[1, 1], layer_type="basic", image_size=32),
    "convnext-tiny-image": _args(model_type="convnext", num_channels=3, patch_size=4, hidden_sizes=[16, 32], num_stages=2,
                                 depths=[1, 1], image_size=32),
}  # fmt: skip
