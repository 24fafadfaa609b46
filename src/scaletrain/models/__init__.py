"""Model families behind one seam (spec.py): the built-in Llama (llama/) and any folder like it (registry.py)."""

from scaletrain.models.registry import families, model_spec, preset_spec, presets, spec_from_manifest
from scaletrain.models.spec import DecoderShape, ModelSpec

__all__ = ["DecoderShape", "ModelSpec", "families", "model_spec", "preset_spec", "presets", "spec_from_manifest"]
