"""Parameter names as the plain single-process model has them, whatever wraps it."""

from __future__ import annotations

# path components wrappers insert: DDP's `module`, activation checkpointing's, torch.compile's
# and peft's `base_layer` (a LoRA-wrapped linear keeps its frozen weight there: same name as without LoRA)
WRAPPER_NAMES = ("module", "_checkpoint_wrapped_module", "_orig_mod", "base_layer")
ADAPTER_MARK = "lora_"  # a path component of peft's adapter weights (lora_A, lora_B, lora_embedding_A, ...)


def plain_param_name(name: str) -> str:
    """A parameter name without the path components wrappers insert (`layers.0._checkpoint_wrapped_module.w` ->
    `layers.0.w`), so a wrapped model initialises and saves under the plain model's names."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)


def is_adapter_name(name: str) -> bool:
    """Is this parameter a LoRA adapter's (peft names them `<target>.lora_A.<adapter>.weight`)?"""
    return any(part.startswith(ADAPTER_MARK) for part in name.split("."))
