"""Where parallel.embedding_sharding puts a model's embedding tables over the data-parallel ranks: the placement
arithmetic the trainer (parallel/embedding.py), job resolution's memory check and the planner share. No torch."""

from __future__ import annotations

SHARDINGS = ("row", "table", "none")


def assign_tables(rows: list[int], ranks: int) -> list[int]:
    """The owner rank of each table under table-wise sharding: largest tables first, each to the rank holding the
    fewest rows so far (ties to the lower rank); the same on every rank."""
    held = [0] * ranks
    owner = [0] * len(rows)
    for t in sorted(range(len(rows)), key=lambda t: (-rows[t], t)):
        r = min(range(ranks), key=lambda k: (held[k], k))
        owner[t], held[r] = r, held[r] + rows[t]
    return owner


def row_range(rows: int, ranks: int, rank: int) -> tuple[int, int]:
    """The rows [start, end) rank `rank` holds of a table split row-wise: torch.chunk's (DTensor Shard(0)'s) cut."""
    chunk = -(-rows // ranks)
    return min(rank * chunk, rows), min((rank + 1) * chunk, rows)


def table_elements_per_rank(rows: list[int], dim: int, how: str, ranks: int) -> int:
    """Table elements the busiest rank holds under sharding `how` ("row", "table" or "none") over `ranks`."""
    if how == "row" and ranks > 1:
        return sum(row_range(n, ranks, 0)[1] for n in rows) * dim  # rank 0 holds torch.chunk's largest cut
    if how == "table" and ranks > 1:
        owner = assign_tables(rows, ranks)
        return max(sum(n for n, o in zip(rows, owner, strict=True) if o == r) for r in range(ranks)) * dim
    return sum(rows) * dim
