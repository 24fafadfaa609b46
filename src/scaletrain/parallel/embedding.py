"""Embedding tables sharded over the data-parallel ranks (parallel.embedding_sharding): a recommender's tables are
most of its parameters (DLRM on Criteo Terabyte: 26 tables, up to 10M rows each), too large to replicate, and each
sample touches one row per table, so the tables are split over the ranks while the MLPs stay data parallel.

- "row": every table's rows split evenly over the ranks (a DTensor sharded on dim 0: checkpoints reshard to any
  rank count through DCP); a rank looks up the rows it holds for every rank's samples and the partial results are
  summed where each sample lives.
- "table": each table whole on one rank (assigned largest first to the rank holding the fewest rows); its owner
  looks it up for every rank's samples. The weight is a plain tensor that only its owner has.

One forward: an all-gather of every rank's ids, the local lookups, and one all-to-all (uneven splits) that sends
each rank its samples' rows: a table-wise owner's rows, a row-wise shard's partial sums. The backward runs the
all-to-all in reverse into the tables. A table's gradient thus sums every rank's samples, which is dp times what
data parallelism gives the MLPs (they average over dp ranks of a loss scaled by dp: train/trainer.py): the rows
are scaled by 1/dp on the way back, so every parameter gets the gradient of one process's mean loss.

torchrec does this with fused kernels, but does not run here: torchrec 1.9.2's fbgemm-gpu-cpu 1.9.0 does not load
beside torch 2.13 ("Could not load this library ... fbgemm_gpu_tbe_index_select.so"), and torchrec 1.8.0 with
fbgemm-gpu-cpu 1.8.0 loads but allows only data_parallel, table_wise, column_wise and table_column_wise on a CPU
(no row_wise), and pip pulls the CUDA fbgemm_gpu beside the CPU one (both install the fbgemm_gpu module).
Checked December 2026.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from scaletrain.config.table_sharding import SHARDINGS, assign_tables, row_range
from scaletrain.parallel.expert import _AllToAll


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient scaled by `factor` on the way back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


class ShardedEmbeddingTables(nn.Module):
    """A model's EmbeddingTables (models/dlrm/model.py: `names`, `rows`, `dim`, `tables`) with its tables split over
    `mesh` (1-D, the data-parallel ranks): the same parameter names (`tables.<name>.weight`), the same forward
    (ids (B, T) int64 -> rows (B, T, D)), every rank calling it with the same B."""

    def __init__(self, tables: nn.Module, mesh, how: str, grad_scale: float):
        super().__init__()
        from torch.distributed.tensor import DTensor, Shard

        src = cast(Any, tables)
        self.names, self.rows, self.dim = list(src.names), list(src.rows), int(src.dim)
        self.how, self.grad_scale = how, grad_scale
        self.group = mesh.get_group()
        self.ranks, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.owner = assign_tables(self.rows, self.ranks) if how == "table" else [-1] * len(self.rows)
        self.tables = nn.ModuleDict()
        for t, name in enumerate(self.names):
            weight = src.tables[name].weight
            if how == "row":
                start, end = row_range(self.rows[t], self.ranks, self.rank)
                local = weight.data.new_empty((end - start, self.dim))  # on meta until the model is materialised
                placed = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                            shape=weight.shape, stride=weight.stride())  # fmt: skip
                holder = nn.Module()
                holder.weight = nn.Parameter(placed, requires_grad=weight.requires_grad)
                self.tables[name] = holder
            elif self.owner[t] == self.rank:
                self.tables[name] = src.tables[name]
        # the contributions this rank sends: row-wise, a partial sum of every table; table-wise, its own tables
        self.mine = [t for t in range(len(self.names)) if how == "row" or self.owner[t] == self.rank]
        counts = [len(self.names) if how == "row" else self.owner.count(r) for r in range(self.ranks)]
        self.sent_by = counts  # contributions per sample each rank sends
        self.bytes_sent = 0  # bytes of looked-up rows sent to other ranks (forward)

    def take_bytes_sent(self) -> int:
        """Bytes of looked-up rows sent to other ranks since the last call (forward; backward sends as many again)."""
        sent, self.bytes_sent = self.bytes_sent, 0
        return sent

    def local_tables(self) -> list[nn.Parameter]:
        """The weights this rank holds (their gradients are reduced here, not by data parallelism)."""
        return [cast(nn.Parameter, m.weight) for m in self.tables.values()]

    def _lookup(self, t: int, ids: torch.Tensor) -> torch.Tensor:
        """Table t's rows for `ids` (every rank's samples): whole on its owner, this shard's partial row-wise."""
        weight = cast(Any, self.tables[self.names[t]]).weight
        if self.how != "row":
            return F.embedding(ids, weight)
        start, end = row_range(self.rows[t], self.ranks, self.rank)
        local = weight.to_local()
        mine = (ids >= start) & (ids < end)
        if end == start:  # this rank holds none of the table's rows: zeros, with an (empty) gradient like any shard
            return local.new_zeros((ids.shape[0], self.dim)) + local.sum()
        rows = F.embedding(torch.where(mine, ids - start, 0), local)
        return rows * mine.unsqueeze(1).to(rows.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, n_tables = ids.shape
        gathered = ids.new_empty((self.ranks * b, n_tables))
        dist.all_gather_into_tensor(gathered, ids.contiguous(), group=self.group)
        rows = torch.tensor(self.rows, device=ids.device)
        everyone = gathered % rows  # the hashing trick, as EmbeddingTables does
        if self.mine:
            looked = torch.stack([self._lookup(t, everyone[:, t]) for t in self.mine], dim=1)  # (ranks·b, n, D)
        else:  # a rank holding no table (more ranks than tables) still takes part in the backward's all-to-all
            looked = everyone.new_zeros((self.ranks * b, 0, self.dim), dtype=torch.float32).requires_grad_()
        send = [b * len(self.mine)] * self.ranks
        recv = [b * n for n in self.sent_by]
        arrived = _AllToAll.apply(looked.reshape(-1, self.dim), recv, send, self.group)
        self.bytes_sent += (sum(send) - send[self.rank]) * self.dim * looked.element_size()
        pieces = arrived.split(recv)
        if self.how == "row":  # every rank sent a partial row of every table: sum them
            out = torch.stack([p.view(b, n_tables, self.dim) for p in pieces]).sum(0)
        else:  # each table's rows come from its owner, in the owner's table order
            by_table: list[torch.Tensor] = [torch.empty(0)] * n_tables
            for r, piece in enumerate(pieces):
                owned = [t for t in range(n_tables) if self.owner[t] == r]
                for k, column in enumerate(piece.view(b, len(owned), self.dim).unbind(1)):
                    by_table[owned[k]] = column
            out = torch.stack(by_table, dim=1)
        return _ScaleGrad.apply(out, self.grad_scale)


def shard_embedding_tables(model: nn.Module, path: str, mesh, how: str, grad_average: int) -> ShardedEmbeddingTables:
    """Replace the EmbeddingTables at `path` of `model` (on meta) by its tables split over `mesh` (`how`: "row" or
    "table"); `grad_average`: the ranks the data-parallel gradients average over. Returns the new module."""
    if how not in ("row", "table"):
        raise ValueError(f"parallel.embedding_sharding: unknown {how!r}; use one of {', '.join(SHARDINGS)}")
    sharded = ShardedEmbeddingTables(model.get_submodule(path), mesh, how, 1.0 / grad_average)
    model.set_submodule(path, sharded)
    return sharded


def sharded_tables(model: nn.Module) -> list[ShardedEmbeddingTables]:
    return [m for m in model.modules() if isinstance(m, ShardedEmbeddingTables)]


def rank_local_params(model: nn.Module) -> list[nn.Parameter]:
    """Weights of table-wise sharded tables: plain tensors only their owner holds (their gradient norm is summed
    over the ranks, train/job.py global_grad_norm)."""
    return [p for m in sharded_tables(model) if m.how == "table" for p in m.local_tables()]


def broadcast_tables(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name in `model`, whole weight on CPU) of every table-wise sharded table, each broadcast from its owner: a
    collective, every rank iterates to the end. Memory: one table at a time."""
    for path, tables in ((n, m) for n, m in model.named_modules() if isinstance(m, ShardedEmbeddingTables)):
        if tables.how != "table":
            continue
        for t, name in enumerate(tables.names):
            owner = tables.owner[t]
            if owner == tables.rank:
                whole = cast(Any, tables.tables[name]).weight.detach().clone()
            else:
                whole = torch.empty((tables.rows[t], tables.dim), device=_device_of(tables))
            dist.broadcast(whole, src=dist.get_global_rank(tables.group, owner), group=tables.group)
            yield f"{path}.tables.{name}.weight", whole.cpu()


def _device_of(tables: ShardedEmbeddingTables) -> torch.device:
    """Where this rank's collectives of the tables run (a rank may hold none of them)."""
    if dist.get_backend(tables.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
