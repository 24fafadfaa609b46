"""MPI launchers: `mpirun -np 8 scaletrain train my.toml` (Open MPI, MPICH, Intel MPI, MVAPICH2, or any PMIx
launcher) starts one process per rank, as Horovod users are used to; each maps the MPI rank variables to
torch.distributed's env:// ones when it joins the process group. Nothing is rendered or submitted for MPI: the
mapping lives with the ranks (scaletrain.parallel.rank_env), and is named here for launcher code and tests.
"""

from scaletrain.parallel.rank_env import (
    FAMILIES,
    apply_mpi_env,
    detect_mpi,
    torch_env_from_mpi,
)

__all__ = ["FAMILIES", "apply_mpi_env", "detect_mpi", "torch_env_from_mpi"]
