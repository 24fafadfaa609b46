"""The built-in Llama's shape: a decoder shape plus its rotary base and norm epsilon. No torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import Field

from scaletrain.models.spec import DecoderShape


@dataclass(frozen=True)
class LlamaArgs(DecoderShape):
    """Every field is a `[model]` key of a Llama preset (model.dim = 256, model.rope_theta = 500000.0, ...)."""

    rope_theta: Annotated[float, Field(gt=0)] = 10000.0
    norm_eps: Annotated[float, Field(gt=0)] = 1e-5

    def check(self) -> None:
        """Raise ValueError naming the field when the shape is not a valid decoder."""
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim: {self.dim} is not divisible by model.n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_kv_heads: {self.n_kv_heads} does not divide model.n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"model.dim: head size {self.head_dim} must be even for rotary embeddings")
