"""Hugging Face causal language models through the normal trainer: `model.hf = PATH` (a local folder with
config.json, with or without safetensors weights; nothing is downloaded) builds transformers' own modules
(AutoModelForCausalLM.from_config) on the meta device and answers the ModelSpec questions for them: blocks found
from the model, TP plan translated from the model's own `base_model_tp_plan` (tp.py), weights read per rank shard
from the safetensors files (weights.py), export back to a folder `from_pretrained` loads.

No presets: an HF spec comes from a folder (registry.model_spec), never from `model.name`."""

from scaletrain.models.hf.args import HFArgs
from scaletrain.models.hf.spec import HFSpec

SPEC = HFSpec
PRESETS: dict[str, HFArgs] = {}

__all__ = ["PRESETS", "SPEC", "HFArgs", "HFSpec"]
