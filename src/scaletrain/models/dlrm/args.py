"""What a DLRM spec is bound to: the widths of its two MLPs, the embedding tables' width and rows, and the data's
columns (bound from a prepared tabular folder by the recommendation task). No torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import Field

from scaletrain.config.schema import MAX_MODEL_DIM

Width = Annotated[int, Field(gt=0, le=MAX_MODEL_DIM)]
Rows = Annotated[int, Field(gt=0, le=1 << 40)]


@dataclass(frozen=True)
class DLRMArgs:
    """DLRM (Naumov et al. 2019): dense features through the bottom MLP to one embedding-wide vector, each
    categorical feature looked up in its own table, the pairwise dot products of all those vectors with the
    bottom MLP's output through the top MLP to one click logit."""

    embedding_dim: Width = 16  # width of every table's rows and of the bottom MLP's output
    bottom_mlp: Sequence[Width] = (64,)  # hidden widths of the dense features' MLP (then embedding_dim)
    top_mlp: Sequence[Width] = (64, 32)  # hidden widths of the top MLP (then one logit)
    # rows of each table: the column's distinct ids in the training data, at most max_rows; an id takes row
    # id % rows (the hashing trick of DLRM's --max-ind-range)
    max_rows: Rows = 100_000
    table_rows: Sequence[Rows] = ()  # each table's rows, one per categorical column; empty: from the data
    n_dense: Annotated[int, Field(ge=0, le=MAX_MODEL_DIM)] = 0  # dense features; 0: the data's
    # the data's categorical columns, one table each, named after them (bound from the data)
    sparse_columns: Sequence[str] = field(default=(), metadata={"config": False})

    def __post_init__(self) -> None:  # TOML and a manifest's JSON give lists: tuples keep the args hashable
        for name in ("bottom_mlp", "top_mlp", "table_rows", "sparse_columns"):
            object.__setattr__(self, name, tuple(getattr(self, name)))


# Criteo's 26 categorical columns as `data prepare --format tabular` names a headerless day file's: C1..C26
CRITEO_SPARSE = tuple(f"C{i}" for i in range(1, 27))

# tiny shapes for tests and first runs on a CPU, and the DLRM reference's Criteo shapes (Naumov et al. 2019,
# facebookresearch/dlrm README: Kaggle `--arch-sparse-feature-size=16 --arch-mlp-bot=13-512-256-64-16
# --arch-mlp-top=512-256-1`; Terabyte `=64`, `13-512-256-64`, `512-512-256-1`, `--max-ind-range=10000000`)
PRESETS = {
    "dlrm-tiny": DLRMArgs(embedding_dim=8, bottom_mlp=(16,), top_mlp=(16,), max_rows=1_000),
    "dlrm-small": DLRMArgs(embedding_dim=16, bottom_mlp=(64, 32), top_mlp=(64, 32), max_rows=100_000),
    "dlrm-criteo-kaggle": DLRMArgs(embedding_dim=16, bottom_mlp=(512, 256, 64), top_mlp=(512, 256),
                                   max_rows=10_000_000, n_dense=13, sparse_columns=CRITEO_SPARSE),
    "dlrm-criteo-terabyte": DLRMArgs(embedding_dim=64, bottom_mlp=(512, 256), top_mlp=(512, 512, 256),
                                     max_rows=10_000_000, n_dense=13, sparse_columns=CRITEO_SPARSE),
}  # fmt: skip
