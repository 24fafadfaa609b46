"""`scaletrain launch k8s`: PyTorchJob and TrainJob manifests that validate, and bad input refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from scaletrain.cli.main import main
from scaletrain.launch.kubernetes import (
    K8S_VERSION,
    K8sOptions,
    ManifestError,
    build_manifests,
    build_pytorchjob,
    validate_pod_template,
    validate_pytorchjob,
    validate_trainjob,
)

FAST = ["train.global_batch_size=16", "data.max_bytes=300000", "data.seq_len=64"]


def _invoke(tmp_path: Path, *args: str):
    return CliRunner().invoke(
        main, ["launch", "k8s", *FAST, f"--out={tmp_path / 'k8s'}", *args], catch_exceptions=False
    )


def test_manifests_validate_and_carry_gpus_shm_elastic_policy_and_scheduler(tmp_path: Path) -> None:
    res = _invoke(
        tmp_path,
        "train.global_batch_size=64",
        "--image",
        "registry.example:5000/team/scaletrain:2.1",
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--min-nodes",
        "2",
        "--pvc",
        "train-runs",
        "--scheduler-name",
        "runai-scheduler",
        "--runai-project",
        "team-a",
        "--env",
        "NCCL_SOCKET_IFNAME=eth0",
    )
    assert res.exit_code == 0, res.output
    cm, pj = yaml.safe_load_all((tmp_path / "k8s" / "pytorchjob.yaml").read_text())
    _, tj = yaml.safe_load_all((tmp_path / "k8s" / "trainjob.yaml").read_text())
    validate_pytorchjob(pj)  # pod templates against Kubernetes' schema, strict
    validate_trainjob(tj)  # the Trainer API's pydantic model + the pod schema

    assert (pj["apiVersion"], pj["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    spec = pj["spec"]
    assert spec["elasticPolicy"] == {"minReplicas": 2, "maxReplicas": 4, "maxRestarts": 3, "rdzvBackend": "c10d"}
    assert spec["nprocPerNode"] == "8"
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 4 and worker["restartPolicy"] == "OnFailure"
    pod = worker["template"]["spec"]
    assert pod["schedulerName"] == "runai-scheduler"
    assert worker["template"]["metadata"]["labels"]["runai/queue"] == "team-a"
    (c,) = pod["containers"]
    assert c["name"] == "pytorch" and c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and "NCCL_DEBUG" in env
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]

    # the config travels as a ConfigMap; outputs go to the PVC; the job trains 4 x 8 ranks
    job_toml = cm["data"]["job.toml"]
    assert 'output_dir = "/scaletrain/runs"' in job_toml and "nnodes = 4" in job_toml
    assert c["command"][-1] == "/etc/scaletrain/job.toml"

    assert (tj["apiVersion"], tj["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert tj["spec"]["trainer"]["numNodes"] == 4 and tj["spec"]["trainer"]["numProcPerNode"] == 8
    assert tj["spec"]["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "8"
    assert tj["spec"]["runtimeRef"]["name"] == "torch-distributed"


def test_cpu_pods_request_no_gpu() -> None:
    pj = build_pytorchjob(K8sOptions(image="scaletrain", nodes=2, gpus_per_node=0, nproc_per_node=2))
    validate_pytorchjob(pj)
    c = pj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert "resources" not in c and pj["spec"]["nprocPerNode"] == "2"


def test_the_validator_catches_what_kubernetes_would_refuse() -> None:
    pj = build_pytorchjob(K8sOptions(image="scaletrain:1", gpus_per_node=1))
    pod = pj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    pod["spec"]["containers"][0]["imagePullPolicy "] = "Always"  # a typo'd field
    with pytest.raises(ManifestError, match="imagePullPolicy "):
        validate_pytorchjob(pj)
    with pytest.raises(ManifestError, match="containers"):
        validate_pod_template({"spec": {"containers": "not-a-list"}}, K8S_VERSION, "t")


@pytest.mark.parametrize(
    "args, field",
    [
        (["--image", "scaletrain", "--gpus-per-node", "8", "--nodes", "-2"], "--nodes"),
        (["--image", "Bad Image!", "--gpus-per-node", "8"], "--image"),
        (["--image", "UPPER/case:1", "--gpus-per-node", "8"], "--image"),
        (["--image", "scaletrain:", "--gpus-per-node", "8"], "--image"),
        (["--image", "scaletrain", "--gpus-per-node", "-1"], "--gpus-per-node"),
        (["--image", "scaletrain", "--gpus-per-node", "8", "--nproc-per-node", "9"], "--nproc-per-node"),
        (["--image", "scaletrain", "--gpus-per-node", "8", "--shm-size", "lots"], "--shm-size"),
        (["--image", "scaletrain", "--gpus-per-node", "8", "--name", "Not_A_Label"], "--name"),
        (["--image", "scaletrain", "--gpus-per-node", "8", "--min-nodes", "3"], "--min-nodes"),
        (["--image", "scaletrain", "--gpus-per-node", "8", "--env", "NOEQUALS"], "--env"),
        (["--image", "scaletrain", "--gpus-per-node", "8", "train.global_batch_size=12"], "train.global_batch_size"),
    ],
)
def test_bad_input_is_one_line(tmp_path: Path, args: list[str], field: str) -> None:
    res = CliRunner().invoke(main, ["launch", "k8s", *FAST, f"--out={tmp_path / 'k8s'}", *args])
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scaletrain: error: ") and field in lines[0], res.stderr
    assert not (tmp_path / "k8s").exists()


def test_build_manifests_returns_both_files() -> None:
    out = build_manifests(K8sOptions(image="scaletrain@sha256:" + "a" * 64, nodes=2, gpus_per_node=4), "x = 1\n")
    assert set(out) == {"pytorchjob.yaml", "trainjob.yaml"}
    assert [d["kind"] for d in out["trainjob.yaml"]] == ["ConfigMap", "TrainJob"]
