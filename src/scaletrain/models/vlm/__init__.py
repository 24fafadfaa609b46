"""Vision-language models from transformers: `model.hf = FOLDER` holding a LLaVA-style config.json (a vision tower,
a multi-modal projector and a causal language model: transformers' LlavaForConditionalGeneration, any vision and
text config it composes, e.g. CLIP or SigLIP with Llama or Qwen2), with or without safetensors weights, and the
model's processor (AutoProcessor: tokenizer + image processor) in the same folder. `model.freeze` leaves parts
untrained (e.g. ["vision"] for LLaVA's fine-tuning stage, ["vision", "language"] for its projector pre-training).
The vision-language task feeds it (tasks/vision_language.py).

Qwen2-VL-style models (pixels as flattened patches with image_grid_thw, M-RoPE positions) are refused before
launch: their forward takes more than (input_ids, pixel_values)."""

from scaletrain.models.vlm.args import VLMArgs
from scaletrain.models.vlm.spec import VLMSpec

SPEC = VLMSpec
PRESETS: dict = {}

__all__ = ["PRESETS", "SPEC", "VLMArgs", "VLMSpec"]
