"""MPI launchers: rank variables of Open MPI, MPICH/Intel MPI, MVAPICH2 and PMIx become torch's env:// ones, and
two processes started the way `mpirun -np 2 scaletrain train` starts them train together."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAST, losses
from scaletrain.launch.local import free_port
from scaletrain.launch.mpi import apply_mpi_env, detect_mpi, torch_env_from_mpi


@pytest.mark.parametrize(
    "env, family",
    [
        (
            {
                "OMPI_COMM_WORLD_RANK": "3",
                "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            },
            "Open MPI",
        ),
        ({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, "MPICH/Intel MPI"),
        (
            {
                "MV2_COMM_WORLD_RANK": "3",
                "MV2_COMM_WORLD_SIZE": "4",
                "MV2_COMM_WORLD_LOCAL_RANK": "1",
                "MV2_COMM_WORLD_LOCAL_SIZE": "2",
            },
            "MVAPICH2",
        ),
        ({"PMIX_RANK": "3", "SLURM_NTASKS": "4", "PMIX_LOCAL_RANK": "1", "PMIX_LOCAL_SIZE": "2"}, "PMIx"),
    ],
)
def test_each_mpi_family_maps_to_torch_variables(env: dict, family: str) -> None:
    env = {**env, "MASTER_ADDR": "node0"}
    assert detect_mpi(env) == family
    out = torch_env_from_mpi(env)
    assert (out["RANK"], out["WORLD_SIZE"], out["LOCAL_RANK"], out["LOCAL_WORLD_SIZE"]) == ("3", "4", "1", "2")
    assert out["MASTER_ADDR"] == "node0" and out["MASTER_PORT"].isdigit()


def test_endpoint_rules() -> None:
    one_host = {
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "PMIX_NAMESPACE": "prterun-host-1234@1",
    }
    out = torch_env_from_mpi(one_host)
    assert out["MASTER_ADDR"] == "127.0.0.1" and 20000 <= int(out["MASTER_PORT"]) < 30000
    assert torch_env_from_mpi(one_host) == out  # every rank derives the same port
    assert torch_env_from_mpi(one_host, "node7:29400")["MASTER_ADDR"] == "node7"
    assert torch_env_from_mpi(one_host, "node7:29400")["MASTER_PORT"] == "29400"
    many_hosts = {**one_host, "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        torch_env_from_mpi(many_hosts, "127.0.0.1:0")
    with pytest.raises(ValueError, match="outside the world"):
        torch_env_from_mpi({"PMI_RANK": "5", "PMI_SIZE": "2"})
    assert torch_env_from_mpi({}) == {}
    torchrun = {"RANK": "0", "WORLD_SIZE": "1", "PMI_RANK": "0", "PMI_SIZE": "2"}
    assert apply_mpi_env(torchrun) is None and torchrun["WORLD_SIZE"] == "1"  # torchrun's variables win


@pytest.mark.slow  # a 2-rank launch; the MPI variables mapping stays fast above, a local 2-rank launch is test_parity.py's
def test_two_processes_started_as_mpirun_does_train_together(tmp_path: Path) -> None:
    # exactly what `mpirun -np 2 -x MASTER_PORT=P scaletrain train ...` (Open MPI) puts in each process
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {
            **base,
            "OMPI_COMM_WORLD_RANK": str(rank),
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "scaletrain.cli.main", "train", *FAST, "run.name=mpi", "train.steps=4"],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "on 2 cpu rank(s)" in outputs[0]
    assert len(losses(tmp_path / "runs" / "mpi")) == 4
