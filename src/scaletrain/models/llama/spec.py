"""The built-in Llama's answers to the ModelSpec questions."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from scaletrain.models.llama.args import LlamaArgs
from scaletrain.models.spec import (
    CONFIG_TP_WORDS,
    DecoderShape,
    HFAdapter,
    ModelSpec,
    TPWords,
    check_tp_divides,
    prune_stage,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

    from scaletrain.models.llama.model import Llama


class LlamaDecoderSpec(ModelSpec):
    """The answers every decoder built on model.py's `Llama` shares (the built-in Llama, and the MoE family that
    swaps its MLP): building, buffers, blocks, pipeline stages, context parallelism. A subclass names its model
    class (`model_type`) and answers the rest (init, TP, export, numbers)."""

    packs_documents = True
    supports_cp = True

    def model_type(self) -> type[Llama]:
        """The nn.Module class `build` makes from `args` (imported here: importing a family imports no torch)."""
        from scaletrain.models.llama.model import Llama

        return Llama

    def check(self) -> None:
        self.args.check()

    def build(self, device: torch.device | str = "meta") -> Llama:
        import torch

        with torch.device(device):
            return self.model_type()(self.args)

    def init_buffers(self, model: nn.Module) -> None:
        from scaletrain.models.llama.model import Llama

        for m in model.modules():
            if isinstance(m, Llama):
                m.init_buffers()

    def blocks(self, model: nn.Module) -> nn.ModuleDict:
        return cast("Llama", model).layers

    def stage(self, model: nn.Module, stage: int, n_stages: int, bounds: tuple[int, int]) -> nn.Module:
        drop = (() if stage == 0 else ("tok_embeddings",)) + (() if stage == n_stages - 1 else ("norm", "output"))
        return prune_stage(model, "layers", bounds, drop)

    def has_output(self, model: nn.Module) -> bool:
        return getattr(model, "output", None) is not None

    def context_parallel(
        self, model: nn.Module, make_core: Callable[[nn.Module], nn.Module], positions: torch.Tensor
    ) -> None:
        from scaletrain.models.llama.model import Attention, Llama

        for m in list(model.modules()):  # a list: cores are replaced while walking
            if isinstance(m, Llama):
                m.positions = positions
            elif isinstance(m, Attention):
                m.core = make_core(m.core)


class LlamaSpec(LlamaDecoderSpec):
    family = "llama"
    args_type = LlamaArgs

    args: LlamaArgs

    def param_init_std(self, name: str) -> float | None:
        from scaletrain.models.llama.model import param_init_std

        return param_init_std(name, self.args)

    def lora_targets(self) -> list[str]:
        return ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]  # attention and SwiGLU projections (model.py)

    def check_tp(self, tp: int, words: TPWords = CONFIG_TP_WORDS) -> None:
        a = self.args
        check_tp_divides(
            tp, words, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, ffn_dim=a.ffn_dim, dim=a.dim, vocab_size=a.vocab_size
        )

    def tp_plan(self, model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> dict:
        from scaletrain.models.llama.parallelize import llama_tp_plan

        return llama_tp_plan(cast("Llama", model), sequence_parallel, loss_parallel)

    def shape(self) -> DecoderShape:
        return self.args

    @property
    def hf(self) -> HFAdapter:
        from scaletrain.models.llama.hf import LlamaHF

        return LlamaHF(self.args)
