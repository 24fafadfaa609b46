"""The built-in mixture-of-experts decoder's shape (DeepSeek-style: fine-grained routed experts, optional shared
experts, a top-k router). No torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from scaletrain.models.spec import ModelDim, SeqLen


@dataclass(frozen=True)
class MoEArgs:
    """Every field is a `[model]` key of an MoE preset (model.n_experts = 16, model.score_func = "softmax", ...).

    Blocks [0, n_dense_layers) have a dense SwiGLU MLP of ffn_dim; the others route each token to top_k of
    n_experts experts (hidden size expert_dim each) and add n_shared_experts always-on experts of the same size.
    """

    dim: ModelDim
    n_layers: ModelDim
    n_heads: ModelDim
    n_kv_heads: ModelDim
    vocab_size: ModelDim
    max_seq_len: SeqLen
    n_experts: ModelDim  # routed experts per MoE block
    top_k: ModelDim  # routed experts per token
    expert_dim: ModelDim  # hidden size of one expert's SwiGLU
    ffn_dim: ModelDim = 1  # hidden size of the dense blocks' SwiGLU (n_dense_layers > 0)
    n_shared_experts: Annotated[int, Field(ge=0)] = 1
    n_dense_layers: Annotated[int, Field(ge=0)] = 0
    # router scores: softmax over experts (Mixtral, Qwen3-MoE) or per-expert sigmoid (DeepSeek-V3)
    score_func: Literal["softmax", "sigmoid"] = "sigmoid"
    route_norm: bool = True  # renormalise the top-k weights of a token to sum to 1
    # auxiliary load-balancing loss (Switch / GShard form: n_experts x sum_e f_e x P_e) per micro-batch; 0: off
    aux_loss_coef: Annotated[float, Field(ge=0)] = 0.0
    # auxiliary-loss-free balancing (DeepSeek-V3): after every optimizer step each expert's selection bias moves
    # by this much toward the mean load (sign of the gap); 0: off
    bias_update_rate: Annotated[float, Field(ge=0)] = 1e-3
    # tokens an expert takes per micro-batch of a rank: ceil(capacity_factor x tokens x top_k / n_experts), the
    # rest dropped (counted); 0: dropless
    capacity_factor: Annotated[float, Field(ge=0)] = 0.0
    rope_theta: Annotated[float, Field(gt=0)] = 10000.0
    norm_eps: Annotated[float, Field(gt=0)] = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def check(self) -> None:
        """Raise ValueError naming the field when the shape is not a valid MoE decoder."""
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim: {self.dim} is not divisible by model.n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_kv_heads: {self.n_kv_heads} does not divide model.n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"model.dim: head size {self.head_dim} must be even for rotary embeddings")
        if self.top_k > self.n_experts:
            raise ValueError(f"model.top_k: {self.top_k} is more than model.n_experts={self.n_experts}")
        if self.n_dense_layers > self.n_layers:
            raise ValueError(f"model.n_dense_layers: {self.n_dense_layers} is more than model.n_layers={self.n_layers}")

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.n_dense_layers

    def active_params(self) -> int:
        """Parameters one token's forward multiplies by (attention, top_k + shared experts, router, head), no
        embedding: the 6·N of FLOPs per token."""
        attn = 2 * self.dim * self.dim + 2 * self.dim * self.n_kv_heads * self.head_dim
        moe = 3 * self.dim * self.expert_dim * (self.top_k + self.n_shared_experts) + self.dim * self.n_experts
        dense = 3 * self.dim * self.ffn_dim
        n_moe = self.n_layers - self.n_dense_layers
        return self.n_layers * attn + n_moe * moe + self.n_dense_layers * dense + self.vocab_size * self.dim
