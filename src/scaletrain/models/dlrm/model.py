"""DLRM (Naumov et al. 2019, "Deep Learning Recommendation Model for Personalization and Recommendation Systems";
the reference is facebookresearch/dlrm): the dense features through the bottom MLP, one embedding table per
categorical feature, the pairwise dot products of the bottom MLP's output and the looked-up rows (the "dot"
interaction), and the top MLP over those products and the bottom output, to one click logit per sample.

The tables live in `EmbeddingTables`, apart from the rest, so that parallel/embedding.py can swap it for tables
sharded over the ranks (row-wise or table-wise) with the same parameter names; the MLPs are the model's `blocks`
(FSDP units)."""

from __future__ import annotations

import torch
from torch import nn


def table_name(column: str, index: int) -> str:
    """The module name of a column's table: the column's name when it is one (letters, digits, _), else t<index>."""
    return column if column and column.replace("_", "a").isalnum() and not column[0].isdigit() else f"t{index}"


class MLP(nn.Sequential):
    """Linear layers of the given widths with a ReLU after each but the last (`last_relu`: after the last too)."""

    def __init__(self, widths: list[int], last_relu: bool):
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
            layers.append(nn.Linear(a, b))
            if i < len(widths) - 2 or last_relu:
                layers.append(nn.ReLU())
        super().__init__(*layers)


class EmbeddingTables(nn.Module):
    """One table per categorical feature; `forward(ids)` with ids (B, T) int64 gives (B, T, D): row id % rows of
    each table (the hashing trick: ids are the data's stable hashes)."""

    def __init__(self, names: list[str], rows: list[int], dim: int):
        super().__init__()
        self.names, self.rows, self.dim = list(names), list(rows), dim
        self.tables = nn.ModuleDict({name: nn.Embedding(n, dim) for name, n in zip(names, rows, strict=True)})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = [self.tables[name](ids[:, t] % n) for t, (name, n) in enumerate(zip(self.names, self.rows))]
        return torch.stack(rows, dim=1)


class DLRM(nn.Module):
    """forward(dense (B, n_dense) float, sparse (B, T) int64) -> click logits (B,)."""

    def __init__(self, n_dense: int, names: list[str], rows: list[int], dim: int, bottom: list[int], top: list[int]):
        super().__init__()
        n = len(names) + 1  # the bottom MLP's output and one row per table
        self.embeddings = EmbeddingTables(names, rows, dim)
        # the MLPs are the blocks: FSDP's units and activation checkpointing's
        self.mlps = nn.ModuleDict(
            {
                "bottom": MLP([n_dense, *bottom, dim], last_relu=True),
                "top": MLP([dim + n * (n - 1) // 2, *top, 1], last_relu=False),
            }
        )
        pairs = torch.tril_indices(n, n, offset=-1)
        self.pairs: torch.Tensor  # (n·(n-1)/2,) flat indices of the pairs strictly below the diagonal
        self.register_buffer("pairs", pairs[0] * n + pairs[1], persistent=False)

    def interact(self, bottom: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The bottom output beside the dot products of every pair of (bottom output, each table's row)."""
        features = torch.cat([bottom.unsqueeze(1), rows], dim=1)  # (B, n, D)
        dots = torch.bmm(features, features.transpose(1, 2)).flatten(1)  # (B, n·n)
        return torch.cat([bottom, dots[:, self.pairs]], dim=1)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        bottom = self.mlps["bottom"](dense)
        rows = self.embeddings(sparse).to(bottom.dtype)
        return self.mlps["top"](self.interact(bottom, rows)).squeeze(-1)
