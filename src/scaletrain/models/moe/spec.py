"""The built-in mixture-of-experts decoder's answers to the ModelSpec questions."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from scaletrain.models.moe.args import MoEArgs
from scaletrain.models.spec import ModelSpec, prune_stage

if TYPE_CHECKING:
    import torch
    from torch import nn

    from scaletrain.models.moe.model import MoETransformer


class MoESpec(ModelSpec):
    family = "moe"
    args_type = MoEArgs
    packs_documents = True
    supports_cp = True

    args: MoEArgs

    def check(self) -> None:
        self.args.check()

    def build(self, device: torch.device | str = "meta") -> MoETransformer:
        import torch

        from scaletrain.models.moe.model import MoETransformer

        with torch.device(device):
            return MoETransformer(self.args)

    def param_init_std(self, name: str) -> float | None:
        from scaletrain.models.moe.model import param_init_std

        return param_init_std(name, self.args)

    def init_buffers(self, model: nn.Module) -> None:
        from scaletrain.models.moe.model import MoEFeedForward, MoETransformer

        for m in model.modules():
            if isinstance(m, (MoETransformer, MoEFeedForward)):
                m.init_buffers()

    def blocks(self, model: nn.Module) -> nn.ModuleDict:
        return cast("MoETransformer", model).layers

    def stage(self, model: nn.Module, stage: int, n_stages: int, bounds: tuple[int, int]) -> nn.Module:
        drop = (() if stage == 0 else ("tok_embeddings",)) + (() if stage == n_stages - 1 else ("norm", "output"))
        return prune_stage(model, "layers", bounds, drop)

    def has_output(self, model: nn.Module) -> bool:
        return getattr(model, "output", None) is not None

    def lora_targets(self) -> list[str]:
        return ["wq", "wk", "wv", "wo"]  # attention projections (the experts' weights are stacked, not Linear)

    def context_parallel(
        self, model: nn.Module, make_core: Callable[[nn.Module], nn.Module], positions: torch.Tensor
    ) -> None:
        from scaletrain.models.llama.model import Attention
        from scaletrain.models.moe.model import MoETransformer

        for m in list(model.modules()):
            if isinstance(m, MoETransformer):
                m.positions = positions
            elif isinstance(m, Attention):
                m.core = make_core(m.core)

    # -- experts ----------------------------------------------------------------------------------------------
    @property
    def n_experts(self) -> int | None:
        return self.args.n_experts

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
