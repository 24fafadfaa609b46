"""A test-only model family, to show that a family is one folder: a 2-block MLP-only language model (each token
predicts the next from itself alone). Found through SCALETRAIN_MODEL_PATH=tests/model_families; nothing in
scaletrain names it."""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.models.spec import ModelSpec, prune_stage


@dataclass(frozen=True)
class MLPArgs:
    dim: int
    n_layers: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int


def _model_classes():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, a: MLPArgs):
            super().__init__()
            self.norm = nn.LayerNorm(a.dim)
            self.up = nn.Linear(a.dim, a.ffn_dim)
            self.down = nn.Linear(a.ffn_dim, a.dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class MLPLM(nn.Module):
        def __init__(self, a: MLPArgs):
            super().__init__()
            self.embed = nn.Embedding(a.vocab_size, a.dim)
            self.blocks = nn.ModuleDict({str(i): Block(a) for i in range(a.n_layers)})
            self.final_norm = nn.LayerNorm(a.dim)
            self.head = nn.Linear(a.dim, a.vocab_size, bias=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.embed(tokens) if self.embed is not None else tokens
            for block in self.blocks.values():
                h = block(h)
            if self.final_norm is not None:
                h = self.final_norm(h)
            return self.head(h) if self.head is not None else h

    return MLPLM


class MLPSpec(ModelSpec):
    family = "mlp-lm"
    args_type = MLPArgs

    def build(self, device="meta"):
        import torch

        with torch.device(device):
            return _model_classes()(self.args)

    def param_init_std(self, name: str) -> float | None:
        if "norm" in name:
            return None if name.endswith("weight") else 0.0
        if name.endswith("bias"):
            return 0.0
        return 1.0 if name.startswith("embed") else 0.02

    def blocks(self, model):
        return model.blocks

    def stage(self, model, stage, n_stages, bounds):
        drop = (() if stage == 0 else ("embed",)) + (() if stage == n_stages - 1 else ("final_norm", "head"))
        return prune_stage(model, "blocks", bounds, drop)

    def has_output(self, model) -> bool:
        return getattr(model, "head", None) is not None

    @property
    def n_blocks(self) -> int:
        return self.args.n_layers

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.args.max_seq_len

    def num_params(self) -> int:
        a = self.args
        block = 2 * a.dim + a.dim * a.ffn_dim + a.ffn_dim + a.ffn_dim * a.dim + a.dim
        return a.n_layers * block + 2 * a.vocab_size * a.dim + 2 * a.dim

    def flops_per_token(self, seq_len: int) -> float:
        a = self.args
        return 6.0 * (a.n_layers * 2 * a.dim * a.ffn_dim + a.dim * a.vocab_size)

    def layer_costs(self, seq_len: int) -> list[float]:
        a = self.args
        costs = [12.0 * a.dim * a.ffn_dim] * a.n_layers
        costs[-1] += 6.0 * a.dim * a.vocab_size
        return costs


SPEC = MLPSpec
PRESETS = {"mlp-tiny": MLPArgs(dim=64, n_layers=2, ffn_dim=256, vocab_size=256, max_seq_len=512)}
