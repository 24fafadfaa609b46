"""The DLRM spec's answers: the model built on meta from its args, the tables' rows bound from the prepared data,
weights filled by name with the reference's initialisation, its MLPs as the blocks, and where its embedding tables
are (parallel/embedding.py shards them over the ranks)."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, cast

from scaletrain.models.dlrm.args import DLRMArgs
from scaletrain.models.dlrm.model import table_name
from scaletrain.models.spec import ModelSpec

if TYPE_CHECKING:
    import torch
    from torch import nn

    from scaletrain.models.dlrm.model import DLRM

TABLES = "embeddings"  # the module path of the model's EmbeddingTables


class DLRMSpec(ModelSpec):
    family = "dlrm"
    args_type = DLRMArgs

    args: DLRMArgs

    # -- construction ---------------------------------------------------------------------------------------
    def check(self) -> None:
        a = self.args
        if a.table_rows and a.sparse_columns and len(a.table_rows) != len(a.sparse_columns):
            raise ValueError(f"model.table_rows: {len(a.table_rows)} tables given for {len(a.sparse_columns)} "
                             f"categorical columns; give one per column or leave it unset")  # fmt: skip
        names = [table_name(c, i) for i, c in enumerate(a.sparse_columns)]
        if len(set(names)) != len(names):
            raise ValueError(f"data.path: categorical columns {', '.join(a.sparse_columns)} give duplicate table "
                             f"names; rename the columns")  # fmt: skip

    @property
    def bound(self) -> bool:
        """Whether the columns are known (from the data, or a preset that names them): the model can be built."""
        return self.args.n_dense > 0 and bool(self.args.sparse_columns)

    def with_data(self, n_dense: int, columns: list[str], distinct: list[int]) -> DLRMSpec:
        """This model for a dataset of `n_dense` dense features and these categorical columns with `distinct` ids
        each (seen in training): one table per column of min(distinct, max_rows) rows unless model.table_rows
        fixes them."""
        a = self.args
        if a.n_dense and a.n_dense != n_dense:
            raise ValueError(f"model.n_dense: the data has {n_dense} dense features, the model {a.n_dense}; "
                             f"leave model.n_dense unset to take the data's")  # fmt: skip
        if a.table_rows and len(a.table_rows) != len(columns):
            raise ValueError(f"model.table_rows: {len(a.table_rows)} tables given for the data's {len(columns)} "
                             f"categorical columns; give one per column or leave it unset")  # fmt: skip
        rows = a.table_rows or tuple(max(1, min(d, a.max_rows)) for d in distinct)
        spec = type(self)(dataclasses.replace(a, n_dense=n_dense, sparse_columns=tuple(columns), table_rows=rows))
        spec.check()
        return spec

    @property
    def table_names(self) -> list[str]:
        return [table_name(c, i) for i, c in enumerate(self.args.sparse_columns)]

    @property
    def rows(self) -> list[int]:
        a = self.args
        return list(a.table_rows) or [a.max_rows] * len(a.sparse_columns)

    def build(self, device: torch.device | str = "meta") -> nn.Module:
        import torch

        from scaletrain.models.dlrm.model import DLRM

        if not self.bound:
            raise ValueError("data.path: the dlrm family takes its dense and categorical columns from the data; set "
                             "data.path to a folder `scaletrain data prepare --format tabular` wrote")  # fmt: skip
        a = self.args
        with torch.device(device):
            model = DLRM(a.n_dense, self.table_names, self.rows, a.embedding_dim, list(a.bottom_mlp), list(a.top_mlp))
        if str(device) != "meta":
            self.init_buffers(model)
        return model

    def param_init_std(self, name: str) -> float | None:
        """The reference's initialisation (facebookresearch/dlrm dlrm_s_pytorch.py) as a normal of the same
        standard deviation: a table's rows uniform in ±1/sqrt(rows) (std 1/sqrt(3·rows)), a linear layer's weight
        sqrt(2 / (fan_in + fan_out)), its bias sqrt(1 / fan_out)."""
        p = self._meta.get_parameter(name)
        if name.startswith(f"{TABLES}."):
            return 1.0 / math.sqrt(3.0 * p.shape[0])
        if p.dim() == 2:
            return math.sqrt(2.0 / (p.shape[0] + p.shape[1]))
        return math.sqrt(1.0 / p.shape[0])

    @property
    def _meta(self) -> DLRM:
        model = self.__dict__.get("_meta_model")
        if model is None:
            model = self.__dict__["_meta_model"] = self.build("meta")
        return cast("DLRM", model)

    def init_buffers(self, model: nn.Module) -> None:
        """The interaction's pair indices (to_empty() leaves them garbage)."""
        import torch

        n = len(self.args.sparse_columns) + 1
        pairs = torch.tril_indices(n, n, offset=-1)
        buf = model.get_buffer("pairs")
        buf.copy_((pairs[0] * n + pairs[1]).to(buf.device))

    # -- structure ------------------------------------------------------------------------------------------
    def blocks(self, model: nn.Module) -> nn.ModuleDict:
        return model.get_submodule("mlps")  # type: ignore[return-value]

    def stage(self, model: nn.Module, stage: int, n_stages: int, bounds: tuple[int, int]) -> nn.Module:
        raise ValueError("parallel.pp: the dlrm family has no pipeline cut; use parallel.pp=1")

    def check_pp(self, pp: int) -> None:
        if pp > 1:
            raise ValueError("parallel.pp: the dlrm family has no pipeline cut; use parallel.pp=1")

    def has_output(self, model: nn.Module) -> bool:
        return True

    def embedding_tables(self) -> str | None:
        return TABLES

    def after_optimizer_step(self, modules: list[nn.Module]) -> dict[str, float]:
        """`table_a2a_bytes`: the rows the tables' all-to-alls sent between ranks in every forward since the last
        step (evaluation too; backward sends as many again), summed over ranks, when parallel.embedding_sharding
        split them (parallel/embedding.py, whose tables count what they send); {} otherwise. Every rank calls it."""
        import torch
        import torch.distributed as dist

        tables: list[Any] = [m for part in modules for m in part.modules() if hasattr(m, "take_bytes_sent")]
        if not tables:
            return {}
        sent = torch.tensor([float(sum(t.take_bytes_sent() for t in tables))], dtype=torch.float64)
        dist.all_reduce(sent, group=tables[0].group)
        return {"table_a2a_bytes": float(sent.item())}

    def example_inputs(self, samples: int) -> tuple[tuple[torch.Tensor, ...], dict]:
        """One micro-batch as the recommendation task feeds the forward: dense features and categorical ids; what
        the planner traces (plan/trace.py)."""
        import torch

        a = self.args
        return (torch.zeros((samples, a.n_dense)), torch.zeros((samples, len(a.sparse_columns)), dtype=torch.int64)), {}

    # -- numbers --------------------------------------------------------------------------------------------
    def table_params(self) -> int:
        return sum(self.rows) * self.args.embedding_dim

    def num_params(self) -> int:
        return sum(p.numel() for p in self._meta.parameters())

    def flops_per_sample(self) -> float:
        """Training FLOPs per sample: 6 per MLP weight (forward, and backward for inputs and weights) and 6·n²·D for
        the interaction's batched matmul (n = tables + 1); the lookups move bytes, not FLOPs."""
        mlp = self.num_params() - self.table_params()
        n = len(self.args.sparse_columns) + 1
        return 6.0 * mlp + 6.0 * n * n * self.args.embedding_dim

    def describe(self) -> str:
        a = self.args
        tables = f"{len(a.sparse_columns)} tables" if self.bound else "tables from the data"
        size = f"{self.num_params() / 1e6:.2f}M params, " if self.bound else ""
        return f"DLRM: {size}{tables} of {a.embedding_dim} wide, bottom MLP {list(a.bottom_mlp)}, top {list(a.top_mlp)}"
