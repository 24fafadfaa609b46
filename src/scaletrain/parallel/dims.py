"""The one DeviceMesh of a Layout's degrees (config/layout.py), and the sub-meshes data parallelism runs on."""

from __future__ import annotations

from scaletrain.config.layout import Layout

# Mesh dims from outermost to innermost (torchtitan's order): pipeline stages cross the slowest links, tensor
# parallel the fastest; context parallel sits next to TP, since it gathers K and V in every block.
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# FSDP shards over data- and context-parallel ranks together (one flattened mesh dim, as torchtitan does): cp ranks
# hold the same weights and each sees part of every sequence, so their gradients are reduced like dp ranks'.
FSDP_SHARD_DIM = "dp_shard_cp"
# Expert parallelism splits dp_shard into (dp_shard / ep) x ep (torchtitan's carving): the ep ranks exchange tokens,
# the experts' weights are sharded by FSDP over the EXPERT_SHARD_DIM ranks that hold the same experts
EXPERT_SHARD_DIM = "dp_shard_mod_ep"
# with context parallelism too, the ranks holding the same experts are EXPERT_SHARD_DIM x cp (cp ranks see other
# tokens of the same sequences, routed like any others): the experts' FSDP dim, flattened across ep
EXPERT_CP_SHARD_DIM = "dp_shard_mod_ep_cp"


def build_mesh(layout: Layout, device_type: str):
    """One DeviceMesh over all ranks with a named dim for every degree > 1 (None on a single rank); with cp > 1
    also the flattened FSDP_SHARD_DIM over dp_shard x cp; with ep > 1 dims EXPERT_SHARD_DIM x ep in place of
    dp_shard, which is their flattened dim."""
    from torch.distributed.device_mesh import init_device_mesh

    sizes = layout.sizes()
    if layout.ep > 1:  # dp_shard becomes a flattened dim over (dp_shard / ep) x ep, both kept even when 1
        order = ("pp", "dp_replicate", EXPERT_SHARD_DIM, "ep", "cp", "tp")
        sizes.update({EXPERT_SHARD_DIM: layout.dp_shard // layout.ep, "ep": layout.ep})
        names = [n for n in order if sizes[n] > 1 or n in (EXPERT_SHARD_DIM, "ep")]
        mesh = init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=tuple(names))
        mesh[EXPERT_SHARD_DIM, "ep"]._flatten("dp_shard")
        if layout.cp > 1:  # torch 2.13 slices and flattens dims that are not adjacent (ep lies between)
            mesh[EXPERT_SHARD_DIM, "ep", "cp"]._flatten(FSDP_SHARD_DIM)
            mesh[EXPERT_SHARD_DIM, "cp"]._flatten(EXPERT_CP_SHARD_DIM)
        return mesh
    names = [n for n in MESH_ORDER if sizes[n] > 1]
    if not names:
        return None
    mesh = init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=tuple(names))
    if layout.cp > 1:
        mesh[tuple(n for n in ("dp_shard", "cp") if n in names)]._flatten(FSDP_SHARD_DIM)
    return mesh


def fsdp_mesh(layout: Layout, mesh):
    """The mesh FSDP2 shards over: dp_shard (x cp), with dp_replicate outside it for HSDP."""
    import warnings

    shard = FSDP_SHARD_DIM if layout.cp > 1 else "dp_shard"
    with warnings.catch_warnings():
        # torch 2.13 warns that slicing a flattened dim from the root mesh "will be deprecated in PT 2.11"; it is
        # how torchtitan builds the dp_shard_cp mesh, and it still works
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh["dp_replicate", shard] if layout.dp_replicate > 1 else mesh[shard]


def dp_coordinates(layout: Layout, mesh) -> tuple[int, int]:
    """(rank among data-parallel ranks, data-parallel degree) of this process."""
    if mesh is None:
        return 0, 1
    rank = 0
    for name in ("dp_replicate", "dp_shard"):
        if layout.sizes()[name] > 1:  # dp_shard may be a flattened dim (expert parallelism)
            rank = rank * mesh[name].size() + mesh[name].get_local_rank()
    return rank, layout.dp


def experts_apart(layout: Layout) -> bool:
    """Whether an MoE model's routed experts are sharded by FSDP2 over a mesh of their own (expert_fsdp_mesh):
    under expert parallelism, and under TP, whose ranks each run a piece of the tokens through whole experts."""
    return layout.ep > 1 or layout.tp > 1


def expert_fsdp_mesh(layout: Layout, mesh):
    """The mesh FSDP2 shards the routed experts' weights over: the ranks holding the same experts, dp_shard / ep
    (x cp) (x tp: each TP rank runs other tokens through them), one flattened dim, with dp_replicate outside it for
    HSDP. Flattened on first use (every rank applies FSDP in the same order)."""
    import warnings

    dims = [EXPERT_SHARD_DIM if layout.ep > 1 else "dp_shard"] + [d for d in ("cp", "tp") if layout.sizes()[d] > 1]
    shard = "_".join(dims)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")  # as in fsdp_mesh
        if len(dims) > 1:  # once: torch returns the dim it flattened before
            mesh[tuple(dims)]._flatten(shard)
        return mesh["dp_replicate", shard] if layout.dp_replicate > 1 else mesh[shard]
