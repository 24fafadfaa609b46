"""The rank variables a launcher hands each process: torchrun's RANK/WORLD_SIZE, or those of an MPI launcher
(`mpirun`/`mpiexec`: Open MPI, MPICH, Intel MPI, MVAPICH2, PMIx) turned into them. Torch-free: the command reads it
before anything heavy is imported, the ranks when they join the process group (runtime.py).

MPI only starts the processes: the ranks then meet over torch.distributed (NCCL or gloo) at MASTER_ADDR:MASTER_PORT,
taken from the environment (`mpirun -x MASTER_ADDR=node0` with Open MPI, `-genv` with MPICH/Intel MPI), else from
launch.rdzv_endpoint, else 127.0.0.1 when all ranks share one host.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, MutableMapping

# (rank, world size, local rank, local world size) variables, per MPI family; the first family whose rank
# variable is set wins. Sources: Open MPI mpirun(1) "Exported environment variables"; MPICH and Intel MPI
# Hydra (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS); MVAPICH2 user guide; PMIx standard (PMIX_RANK).
FAMILIES = (
    (
        "Open MPI",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    (
        "MVAPICH2",
        "MV2_COMM_WORLD_RANK",
        "MV2_COMM_WORLD_SIZE",
        "MV2_COMM_WORLD_LOCAL_RANK",
        "MV2_COMM_WORLD_LOCAL_SIZE",
    ),
    ("MPICH/Intel MPI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("PMIx", "PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
)
# world size for a PMIx launcher that exports only the rank (srun --mpi=pmix sets SLURM_NTASKS)
_SIZE_FALLBACKS = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
# a per-launch id, so concurrent single-host launches pick different default ports
_JOB_IDS = ("PMIX_NAMESPACE", "OMPI_MCA_orte_hnp_uri", "OMPI_MCA_ess_base_jobid", "PMI_KVSNAME")
DEFAULT_PORT = 29500  # torch.distributed's customary MASTER_PORT


def detect_mpi(env: Mapping[str, str] = os.environ) -> str | None:
    """The MPI family whose rank variable is set, or None."""
    for family, rank_var, *_ in FAMILIES:
        if rank_var in env:
            return family
    return None


def _port_for(env: Mapping[str, str]) -> int:
    for var in _JOB_IDS:
        if env.get(var):
            digest = hashlib.sha256(env[var].encode()).digest()
            return 20000 + int.from_bytes(digest[:4], "big") % 10000  # unprivileged, below the ephemeral range
    return DEFAULT_PORT


def torch_env_from_mpi(env: Mapping[str, str] = os.environ, rdzv_endpoint: str | None = None) -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT for this MPI rank; {} when no MPI
    launcher is detected. ValueError (one line) when the variables are inconsistent or the endpoint is unknown."""
    for family, rank_var, size_var, local_var, local_size_var in FAMILIES:
        if rank_var not in env:
            continue
        size = env.get(size_var) or next((env[v] for v in _SIZE_FALLBACKS if env.get(v)), None)
        if size is None:
            raise ValueError(f"{family}: {rank_var} is set but not {size_var}; cannot tell the world size")
        try:
            rank, world = int(env[rank_var]), int(size)
            local_rank = int(env.get(local_var, rank))
            local_world = int(env[local_size_var]) if env.get(local_size_var) else None
        except ValueError:
            raise ValueError(f"{family}: rank variables are not integers ({rank_var}={env[rank_var]!r})") from None
        if not 0 <= rank < world:
            raise ValueError(f"{family}: {rank_var}={rank} is outside the world size {world}")
        one_host = local_world == world or env.get("SLURM_NNODES") == "1"
        out = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank)}
        if local_world:
            out["LOCAL_WORLD_SIZE"] = str(local_world)
        addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
        host, _, cfg_port = (rdzv_endpoint or "").rpartition(":")
        if host and not (host in ("127.0.0.1", "localhost") and not one_host):
            addr = addr or host
            port = port or (cfg_port if cfg_port not in ("", "0") else None)
        if not addr:
            if not one_host:
                raise ValueError(
                    f"{family}: ranks may span several hosts; set MASTER_ADDR to rank 0's host "
                    f"(e.g. mpirun -x MASTER_ADDR=node0) or launch.rdzv_endpoint=node0:29500"
                )
            addr = "127.0.0.1"
        out["MASTER_ADDR"] = addr
        out["MASTER_PORT"] = port or str(_port_for(env))
        return out
    return {}


def apply_mpi_env(environ: MutableMapping[str, str] = os.environ, rdzv_endpoint: str | None = None) -> str | None:
    """Under an MPI launcher without torch's variables, set them in environ; returns the family, else None."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return None
    mapped = torch_env_from_mpi(environ, rdzv_endpoint)
    if not mapped:
        return None
    for key, value in mapped.items():
        environ.setdefault(key, value)
    return detect_mpi(environ)


def under_external_launcher(env: Mapping[str, str] = os.environ) -> bool:
    """True inside a process started by an external torchrun (or any launcher setting RANK/WORLD_SIZE), or by
    mpirun/mpiexec (Open MPI, MPICH, Intel MPI, MVAPICH2, PMIx rank variables)."""
    return ("RANK" in env and "WORLD_SIZE" in env) or detect_mpi(env) is not None
