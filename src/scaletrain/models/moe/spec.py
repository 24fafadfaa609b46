"""The built-in mixture-of-experts decoder's answers to the ModelSpec questions."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from scaletrain.models.llama.spec import LlamaDecoderSpec
from scaletrain.models.moe.args import MoEArgs
from scaletrain.models.spec import CONFIG_TP_WORDS, TPWords, check_tp_divides

if TYPE_CHECKING:
    from torch import nn

    from scaletrain.models.moe.model import MoETransformer


class MoESpec(LlamaDecoderSpec):
    """Llama's decoder answers (build, stages, CP: models/llama/spec.py) with routed experts in the MLPs."""

    family = "moe"
    args_type = MoEArgs

    args: MoEArgs

    def model_type(self) -> type[MoETransformer]:
        from scaletrain.models.moe.model import MoETransformer

        return MoETransformer

    def param_init_std(self, name: str) -> float | None:
        from scaletrain.models.moe.model import param_init_std

        return param_init_std(name, self.args)

    def init_buffers(self, model: nn.Module) -> None:
        from scaletrain.models.moe.model import MoEFeedForward

        super().init_buffers(model)
        for m in model.modules():
            if isinstance(m, MoEFeedForward):
                m.init_buffers()

    def check_tp(self, tp: int, words: TPWords = CONFIG_TP_WORDS) -> None:
        """Llama's divisibility (heads, dense MLP, embeddings); the MoE blocks split tokens, not weights, so
        routing that depends on which tokens share a rank (a capacity, the auxiliary loss) is refused."""
        a = self.args
        dense = {"ffn_dim": a.ffn_dim} if a.n_dense_layers else {}
        check_tp_divides(
            tp, words, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, dim=a.dim, vocab_size=a.vocab_size, **dense
        )
        for field, value in (("capacity_factor", a.capacity_factor), ("aux_loss_coef", a.aux_loss_coef)):
            if value > 0:
                raise ValueError(
                    f"{words.tp}: each TP rank routes a piece of every sequence, so model.{field}={value:g} would "
                    f"act on other token groups than one process; use model.{field}=0 or {words.tp_off}"
                )

    def tp_plan(self, model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> dict:
        from scaletrain.models.moe.parallelize import moe_tp_plan

        return moe_tp_plan(cast("MoETransformer", model), sequence_parallel, loss_parallel)

    def lora_targets(self) -> list[str]:
        return ["wq", "wk", "wv", "wo"]  # attention projections (the experts' weights are stacked, not Linear)

    # -- experts ----------------------------------------------------------------------------------------------
    @property
    def splits_experts(self) -> bool:
        return True

    @property
    def n_experts(self) -> int | None:
        return self.args.n_experts

    @property
    def experts_per_token(self) -> int | None:
        return self.args.top_k

    def expert_modules(self, model: nn.Module) -> list[nn.Module]:
        from scaletrain.models.moe.model import MoEFeedForward

        return [m for m in model.modules() if isinstance(m, MoEFeedForward)]

    def after_optimizer_step(self, modules: list[nn.Module]) -> dict[str, float]:
        from scaletrain.models.moe.balance import balance_experts

        return balance_experts(modules, self.args.n_layers, self.args.n_experts)

    # -- numbers --------------------------------------------------------------------------------------------
    @property
    def n_blocks(self) -> int:
        return self.args.n_layers

    @property
    def hidden_dim(self) -> int:
        return self.args.dim

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.args.max_seq_len

    def flops_per_token(self, seq_len: int) -> float:
        """6 x the parameters a token is multiplied by (top_k + shared experts, not all of them) + 12·L·h·s
        attention (the PaLM convention the dense family uses)."""
        a = self.args
        return 6.0 * a.active_params() + 12.0 * a.n_layers * a.dim * seq_len
