"""Parallel degrees resolved against a world size, and the one DeviceMesh built from them."""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.config.schema import ParallelConfig

# Mesh dims from outermost to innermost (torchtitan's order): pipeline stages cross the slowest links, tensor
# parallel the fastest; context parallel sits next to TP, since it gathers K and V in every block.
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# FSDP shards over data- and context-parallel ranks together (one flattened mesh dim, as torchtitan does): cp ranks
# hold the same weights and each sees part of every sequence, so their gradients are reduced like dp ranks'.
FSDP_SHARD_DIM = "dp_shard_cp"


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int = 1

    @classmethod
    def resolve(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        """Fill dp_shard=-1 and check that the degrees multiply to world_size; ValueError names the field."""
        fixed = cfg.dp_replicate * cfg.tp * cfg.pp * cfg.cp
        if cfg.dp_shard == -1:
            if world_size % fixed:
                raise ValueError(
                    f"parallel: dp_replicate x tp x pp x cp = {fixed} does not divide the world size {world_size}; "
                    f"change parallel.dp_replicate/tp/pp/cp or the number of ranks"
                )
            dp_shard = world_size // fixed
        else:
            dp_shard = cfg.dp_shard
        if fixed * dp_shard != world_size:
            raise ValueError(
                f"parallel: dp_replicate x dp_shard x tp x pp x cp = {cfg.dp_replicate} x {dp_shard} x {cfg.tp} x "
                f"{cfg.pp} x {cfg.cp} = {fixed * dp_shard}, but the world size is {world_size}; "
                f"set parallel.dp_shard=-1 to fill it"
            )
        return cls(cfg.dp_replicate, dp_shard, cfg.tp, cfg.pp, cfg.cp)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def mode(self) -> str:
        """'single', 'ddp', 'fsdp' or 'hsdp': how data parallelism is applied (cp ranks shard with FSDP)."""
        if self.dp_shard * self.cp > 1:
            return "hsdp" if self.dp_replicate > 1 else "fsdp"
        return "ddp" if self.dp_replicate > 1 else "single"

    def sizes(self) -> dict[str, int]:
        return {
            "pp": self.pp,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "cp": self.cp,
            "tp": self.tp,
        }

    @property
    def grad_average(self) -> int:
        """Ranks the data-parallel gradient reduction averages over: dp x cp (each cp rank's loss covers a cp-th
        of its sequences, so the loss scale must count them for the average to be the gradient of the sum)."""
        return self.dp * self.cp

    def describe(self) -> str:
        used = [f"{k}={v}" for k, v in self.sizes().items() if v > 1]
        if self.mode == "single":  # no data parallelism: name only the model-parallel dims
            return " x ".join(used) if used else "single (one rank)"
        return f"{self.mode} ({' x '.join(used)})"


def build_mesh(dims: ParallelDims, device_type: str):
    """One DeviceMesh over all ranks with a named dim for every degree > 1 (None on a single rank); with cp > 1
    also the flattened FSDP_SHARD_DIM over dp_shard x cp."""
    from torch.distributed.device_mesh import init_device_mesh

    names = [n for n in MESH_ORDER if dims.sizes()[n] > 1]
    if not names:
        return None
    mesh = init_device_mesh(device_type, tuple(dims.sizes()[n] for n in names), mesh_dim_names=tuple(names))
    if dims.cp > 1:
        mesh[tuple(n for n in ("dp_shard", "cp") if n in names)]._flatten(FSDP_SHARD_DIM)
    return mesh


def fsdp_mesh(dims: ParallelDims, mesh):
    """The mesh FSDP2 shards over: dp_shard (x cp), with dp_replicate outside it for HSDP."""
    import warnings

    shard = FSDP_SHARD_DIM if dims.cp > 1 else "dp_shard"
    with warnings.catch_warnings():
        # torch 2.13 warns that slicing a flattened dim from the root mesh "will be deprecated in PT 2.11"; it is
        # how torchtitan builds the dp_shard_cp mesh, and it still works
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh["dp_replicate", shard] if dims.dp_replicate > 1 else mesh[shard]


def dp_coordinates(dims: ParallelDims, mesh) -> tuple[int, int]:
    """(rank among data-parallel ranks, data-parallel degree) of this process."""
    if mesh is None:
        return 0, 1
    rank = 0
    for name in ("dp_replicate", "dp_shard"):
        if name in (mesh.mesh_dim_names or ()):
            rank = rank * mesh[name].size() + mesh[name].get_local_rank()
    return rank, dims.dp
