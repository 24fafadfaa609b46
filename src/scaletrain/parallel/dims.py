"""Parallel degrees resolved against a world size, and the one DeviceMesh built from them."""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.config.schema import ParallelConfig

# Mesh dims from outermost to innermost: pipeline stages cross the slowest links, tensor parallel the fastest.
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int

    @classmethod
    def resolve(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        """Fill dp_shard=-1 and check that the degrees multiply to world_size; ValueError names the field."""
        fixed = cfg.dp_replicate * cfg.tp * cfg.pp
        if cfg.dp_shard == -1:
            if world_size % fixed:
                raise ValueError(
                    f"parallel: dp_replicate x tp x pp = {fixed} does not divide the world size {world_size}; "
                    f"change parallel.dp_replicate/tp/pp or the number of ranks"
                )
            dp_shard = world_size // fixed
        else:
            dp_shard = cfg.dp_shard
        if fixed * dp_shard != world_size:
            raise ValueError(
                f"parallel: dp_replicate x dp_shard x tp x pp = {cfg.dp_replicate} x {dp_shard} x {cfg.tp} x {cfg.pp}"
                f" = {fixed * dp_shard}, but the world size is {world_size}; set parallel.dp_shard=-1 to fill it"
            )
        return cls(cfg.dp_replicate, dp_shard, cfg.tp, cfg.pp)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def mode(self) -> str:
        """'single', 'ddp', 'fsdp' or 'hsdp': how data parallelism is applied."""
        if self.dp_shard > 1:
            return "hsdp" if self.dp_replicate > 1 else "fsdp"
        return "ddp" if self.dp_replicate > 1 else "single"

    def sizes(self) -> dict[str, int]:
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}

    def describe(self) -> str:
        used = [f"{k}={v}" for k, v in self.sizes().items() if v > 1]
        if self.mode == "single":  # no data parallelism: name only the model-parallel dims
            return " x ".join(used) if used else "single (one rank)"
        return f"{self.mode} ({' x '.join(used)})"


def build_mesh(dims: ParallelDims, device_type: str):
    """One DeviceMesh over all ranks with a named dim for every degree > 1 (None on a single rank)."""
    from torch.distributed.device_mesh import init_device_mesh

    names = [n for n in MESH_ORDER if dims.sizes()[n] > 1]
    if not names:
        return None
    return init_device_mesh(device_type, tuple(dims.sizes()[n] for n in names), mesh_dim_names=tuple(names))


def dp_coordinates(dims: ParallelDims, mesh) -> tuple[int, int]:
    """(rank among data-parallel ranks, data-parallel degree) of this process."""
    if mesh is None:
        return 0, 1
    rank = 0
    for name in ("dp_replicate", "dp_shard"):
        if name in (mesh.mesh_dim_names or ()):
            rank = rank * mesh[name].size() + mesh[name].get_local_rank()
    return rank, dims.dp
