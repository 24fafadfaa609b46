"""Built-in models: a Llama-style decoder and its presets."""

from scaletrain.models.llama import Llama, LlamaArgs, init_weights
from scaletrain.models.registry import PRESETS, build_model, model_args

__all__ = ["PRESETS", "Llama", "LlamaArgs", "build_model", "init_weights", "model_args"]
