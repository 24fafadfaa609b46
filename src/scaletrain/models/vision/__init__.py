"""Image classifiers from transformers' own vision models (ViT, ResNet, ConvNeXt, ... any config that
AutoModelForImageClassification builds): `model.hf = FOLDER` holding a vision config.json (with or without
safetensors weights), or a preset (`model.name = "vit-tiny-image"`) whose config fields are `[model]` keys.
`model.num_labels` sets the classes; unset, the image-classification task takes them from the prepared data.

timm is not used: it imports torchvision, which does not import beside the pinned torch 2.13.0 CPU build
(pyproject.toml, DEVELOPERS.md)."""

from scaletrain.models.vision.args import PRESETS, VisionArgs
from scaletrain.models.vision.spec import VisionSpec

SPEC = VisionSpec

__all__ = ["PRESETS", "SPEC", "VisionArgs", "VisionSpec"]
