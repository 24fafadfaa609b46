"""Parameter names as the plain single-process model has them, whatever wraps it."""

from __future__ import annotations

# path components wrappers insert: DDP's `module`, activation checkpointing's, torch.compile's
WRAPPER_NAMES = ("module", "_checkpoint_wrapped_module", "_orig_mod")


def plain_param_name(name: str) -> str:
    """A parameter name without the path components wrappers insert (`layers.0._checkpoint_wrapped_module.w` ->
    `layers.0.w`), so a wrapped model initialises and saves under the plain model's names."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)
