"""Kubernetes: a Kubeflow PyTorchJob (training-operator v1) and a Kubeflow Trainer v2 TrainJob for one run.

Both are built from the Kubeflow SDKs' own model classes (`kubeflow-training` for PyTorchJob, `kubeflow`'s
Trainer API models for TrainJob), so field names and types are theirs, not ours. Before anything is written:
every pod template is checked against Kubernetes' real OpenAPI schema by kubernetes-validate (strict: unknown
fields are errors; PyTorchJob itself has no bundled schema, so each replica's template is wrapped as a v1
PodTemplate), the TrainJob through its pydantic model, and quantities through the Kubernetes client's parser.

Each pod runs `python -m torch.distributed.run -m scaletrain.cli.main train /etc/scaletrain/job.toml`: the
operator sets PET_* variables (nodes, rendezvous endpoint, ranks per node) that torchrun reads, and
`scaletrain train` runs as the rank torchrun started. The resolved job config travels as a ConfigMap.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from scaletrain.launch.counts import check_rank_counts

CONFIG_MOUNT = "/etc/scaletrain"
RUNS_MOUNT = "/scaletrain/runs"  # where a --pvc volume is mounted; run.output_dir points here then
CONTAINER = "pytorch"  # the container name the training operator looks for in a PyTorchJob
TRAINJOB_CONTAINER = "node"  # the trainer container of Trainer v2's torch-distributed runtime
K8S_VERSION = "1.31"  # schema version the pod templates are validated against by default
# NCCL: fail a hung collective instead of waiting forever, so the elastic agent can restart the group
NCCL_ENV = {"NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}

# Image references, after the grammar of distribution/reference (the library docker and containerd use)
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_DOMAIN = rf"(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
_IMAGE = re.compile(
    rf"^(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*(?::[\w][\w.-]{{0,127}})?"
    rf"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{{32,}})?$"
)
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


class ManifestError(ValueError):
    """A manifest could not be built or did not validate; the message is one line."""


@dataclass
class K8sOptions:
    image: str
    nodes: int = 1
    gpus_per_node: int = 0
    nproc_per_node: int = 0  # ranks per pod; 0: gpus_per_node, or 2 CPU ranks when that is 0 too
    name: str = "scaletrain"
    namespace: str = "default"
    min_nodes: int | None = None  # elastic lower bound; default: nodes (a fixed-size job)
    max_restarts: int = 3  # worker-group restarts by the elastic agent
    shm_size: str = "16Gi"  # /dev/shm (memory-backed emptyDir): NCCL and data workers need more than 64 MiB
    cpu: str | None = None  # per-pod CPU request/limit
    memory: str | None = None  # per-pod memory request/limit
    pvc: str | None = None  # PersistentVolumeClaim for run outputs and checkpoints
    scheduler_name: str | None = None  # e.g. runai-scheduler
    runai_project: str | None = None  # Run:AI queue label
    env: dict[str, str] = field(default_factory=dict)
    k8s_version: str = K8S_VERSION

    def ranks_per_node(self) -> int:
        return self.nproc_per_node or self.gpus_per_node or 2


def job_name_for(run_name: str) -> str:
    """A DNS-1035 label from a run name: lowercase, '-' for anything else, starting with a letter."""
    name = re.sub(r"[^a-z0-9-]+", "-", run_name.lower()).strip("-")
    name = name if name[:1].isalpha() else f"st-{name}"
    return name[:50].rstrip("-") or "scaletrain"


def check_options(opts: K8sOptions) -> None:
    """Refuse bad input before anything is built: ManifestError with one line naming the option."""
    from kubernetes.utils import parse_quantity

    check_rank_counts(opts.nodes, opts.gpus_per_node, opts.nproc_per_node, "pod", ManifestError)
    first, slash, _ = opts.image.partition("/")
    # as docker reads it: the first part names a registry only with a '.' or ':' in it, or as localhost
    bad_first = slash and not ("." in first or ":" in first or first == "localhost") and first != first.lower()
    if not _IMAGE.match(opts.image) or len(opts.image) > 255 or bad_first:
        raise ManifestError(
            f"--image: {opts.image!r} is not an image reference like "
            f"registry.example/team/scaletrain:1.0 (lowercase repository, optional :tag or @digest)"
        )
    if not _DNS1035.match(opts.name):
        raise ManifestError(
            f"--name: {opts.name!r} must be a DNS-1035 label (lowercase letters, digits, '-', "
            f"starting with a letter, at most 63 characters)"
        )
    if not _DNS1035.match(opts.namespace) and not re.match(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", opts.namespace):
        raise ManifestError(f"--namespace: {opts.namespace!r} is not a valid namespace name")
    if opts.min_nodes is not None and not 1 <= opts.min_nodes <= opts.nodes:
        raise ManifestError(f"--min-nodes: must be between 1 and --nodes {opts.nodes} (got {opts.min_nodes})")
    if opts.max_restarts < 0:
        raise ManifestError(f"--max-restarts: must be 0 or more (got {opts.max_restarts})")
    for flag, value in (("--shm-size", opts.shm_size), ("--cpu", opts.cpu), ("--memory", opts.memory)):
        if value is None:
            continue
        try:
            if parse_quantity(value) <= 0:
                raise ValueError
        except ValueError:
            raise ManifestError(f"{flag}: {value!r} is not a positive Kubernetes quantity (e.g. 16Gi, 500m)") from None
    if opts.pvc is not None and not re.match(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$", opts.pvc):
        raise ManifestError(f"--pvc: {opts.pvc!r} is not a valid PersistentVolumeClaim name")
    for key in opts.env:
        if not _ENV_NAME.match(key):
            raise ManifestError(f"--env: {key!r} is not a valid environment variable name")


def _env_list(opts: K8sOptions) -> list[tuple[str, str]]:
    return list({**NCCL_ENV, **opts.env}.items())


def _volumes(opts: K8sOptions, config_map: str) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts) as plain dicts: /dev/shm, the job config, and the run folder when a PVC is given."""
    volumes: list[dict] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": opts.shm_size}},
        {"name": "job-config", "configMap": {"name": config_map}},
    ]
    mounts: list[dict] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "job-config", "mountPath": CONFIG_MOUNT, "readOnly": True},
    ]
    if opts.pvc:
        volumes.append({"name": "runs", "persistentVolumeClaim": {"claimName": opts.pvc}})
        mounts.append({"name": "runs", "mountPath": RUNS_MOUNT})
    return volumes, mounts


def _resources(opts: K8sOptions) -> dict:
    limits: dict[str, str] = {}
    if opts.gpus_per_node:
        limits["nvidia.com/gpu"] = str(opts.gpus_per_node)
    if opts.cpu:
        limits["cpu"] = opts.cpu
    if opts.memory:
        limits["memory"] = opts.memory
    return {"limits": dict(limits), "requests": dict(limits)} if limits else {}


def train_command() -> list[str]:
    """The container command: torchrun (configured by the operator's PET_* variables) around `scaletrain train`."""
    return ["python", "-m", "torch.distributed.run", "-m", "scaletrain.cli.main", "train", f"{CONFIG_MOUNT}/job.toml"]


def config_map(opts: K8sOptions, job_toml: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": f"{opts.name}-config",
            "namespace": opts.namespace,
            "labels": {"app.kubernetes.io/managed-by": "scaletrain"},
        },
        "data": {"job.toml": job_toml},
    }


def _labels(opts: K8sOptions) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "scaletrain", "app.kubernetes.io/instance": opts.name}
    if opts.runai_project:
        labels["runai/queue"] = opts.runai_project
    return labels


def _client_volume(k8s, v: dict):
    """A kubernetes-client V1Volume from one of _volumes' dicts."""
    if "emptyDir" in v:
        return k8s.V1Volume(
            name=v["name"],
            empty_dir=k8s.V1EmptyDirVolumeSource(medium=v["emptyDir"]["medium"], size_limit=v["emptyDir"]["sizeLimit"]),
        )
    if "configMap" in v:
        return k8s.V1Volume(name=v["name"], config_map=k8s.V1ConfigMapVolumeSource(name=v["configMap"]["name"]))
    return k8s.V1Volume(
        name=v["name"],
        persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
            claim_name=v["persistentVolumeClaim"]["claimName"]
        ),
    )


def build_pytorchjob(opts: K8sOptions) -> dict:
    """The PyTorchJob manifest (camelCase dict) from kubeflow-training's model classes."""
    from kubeflow.training import models as kf
    from kubernetes import client as k8s

    volumes, mounts = _volumes(opts, f"{opts.name}-config")
    api = k8s.ApiClient()
    container = k8s.V1Container(
        name=CONTAINER,
        image=opts.image,
        command=train_command(),
        env=[k8s.V1EnvVar(name=k, value=v) for k, v in _env_list(opts)],
        resources=k8s.V1ResourceRequirements(**_resources(opts)) if _resources(opts) else None,
        volume_mounts=[
            k8s.V1VolumeMount(name=m["name"], mount_path=m["mountPath"], read_only=m.get("readOnly")) for m in mounts
        ],
    )
    pod_spec = k8s.V1PodSpec(
        containers=[container], scheduler_name=opts.scheduler_name, volumes=[_client_volume(k8s, v) for v in volumes]
    )
    template = k8s.V1PodTemplateSpec(metadata=k8s.V1ObjectMeta(labels=_labels(opts)), spec=pod_spec)
    min_nodes = opts.min_nodes or opts.nodes
    job = kf.KubeflowOrgV1PyTorchJob(
        api_version="kubeflow.org/v1",
        kind="PyTorchJob",
        metadata=k8s.V1ObjectMeta(name=opts.name, namespace=opts.namespace, labels=_labels(opts)),
        spec=kf.KubeflowOrgV1PyTorchJobSpec(
            # OnFailure, not ExitCode: the trainer's "requeue me" (75) would count as a permanent error there
            pytorch_replica_specs={
                "Worker": kf.KubeflowOrgV1ReplicaSpec(
                    replicas=opts.nodes, restart_policy="OnFailure", template=template
                )
            },
            elastic_policy=kf.KubeflowOrgV1ElasticPolicy(
                min_replicas=min_nodes, max_replicas=opts.nodes, max_restarts=opts.max_restarts, rdzv_backend="c10d"
            ),
            nproc_per_node=str(opts.ranks_per_node()),
            run_policy=kf.KubeflowOrgV1RunPolicy(clean_pod_policy="None", backoff_limit=opts.max_restarts + 1),
        ),
    )
    return api.sanitize_for_serialization(job)


def build_trainjob(opts: K8sOptions, runtime: str = "torch-distributed") -> dict:
    """The Trainer v2 TrainJob manifest from the Trainer API's pydantic models (types and required fields checked)."""
    from kubeflow_trainer_api import models as tr
    from pydantic import ValidationError

    volumes, mounts = _volumes(opts, f"{opts.name}-config")
    resources = _resources(opts)
    try:
        pod_patch = tr.TrainerV1alpha1PodTemplatePatch(
            metadata=tr.IoK8sApimachineryPkgApisMetaV1ObjectMeta(labels=_labels(opts)),
            spec=tr.TrainerV1alpha1PodSpecPatch(
                volumes=[tr.IoK8sApiCoreV1Volume.from_dict(v) for v in volumes],
                containers=[
                    tr.TrainerV1alpha1ContainerPatch(
                        name=TRAINJOB_CONTAINER,
                        volume_mounts=[tr.IoK8sApiCoreV1VolumeMount.from_dict(m) for m in mounts],
                    )
                ],
            ),
        )
        job = tr.TrainerV1alpha1TrainJob(
            api_version="trainer.kubeflow.org/v1alpha1",
            kind="TrainJob",
            metadata=tr.IoK8sApimachineryPkgApisMetaV1ObjectMeta(
                name=opts.name, namespace=opts.namespace, labels=_labels(opts)
            ),
            spec=tr.TrainerV1alpha1TrainJobSpec(
                runtime_ref=tr.TrainerV1alpha1RuntimeRef(name=runtime),
                trainer=tr.TrainerV1alpha1Trainer(
                    image=opts.image,
                    command=train_command(),
                    num_nodes=opts.nodes,
                    num_proc_per_node=opts.ranks_per_node(),
                    env=[tr.IoK8sApiCoreV1EnvVar(name=k, value=v) for k, v in _env_list(opts)],
                    resources_per_node=tr.IoK8sApiCoreV1ResourceRequirements.from_dict(resources)
                    if resources
                    else None,
                ),
                runtime_patches=[
                    tr.TrainerV1alpha1RuntimePatch(
                        manager="scaletrain",
                        training_runtime_spec=tr.TrainerV1alpha1TrainingRuntimeSpecPatch(
                            template=tr.TrainerV1alpha1JobSetTemplatePatch(
                                spec=tr.TrainerV1alpha1JobSetSpecPatch(
                                    replicated_jobs=[
                                        tr.TrainerV1alpha1ReplicatedJobPatch(
                                            name="node",
                                            template=tr.TrainerV1alpha1JobTemplatePatch(
                                                spec=tr.TrainerV1alpha1JobSpecPatch(template=pod_patch)
                                            ),
                                        )
                                    ]
                                )
                            )
                        ),
                    )
                ],
            ),
        )
    except ValidationError as e:
        err = e.errors()[0]
        raise ManifestError(f"TrainJob: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    return job.to_dict()


def validate_pod_template(template: dict, version: str, where: str) -> None:
    """Check a pod template against Kubernetes' schema (strict); ManifestError naming the first bad field."""
    wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"}, "template": template}
    _validate(wrapped, version, where)


def _validate(obj: dict, version: str, where: str) -> None:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.path) or "(top)"
        raise ManifestError(f"{where}: {path}: {e.message}") from None
    except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.InvalidSchemaError) as e:
        raise ManifestError(f"{where}: no Kubernetes {version} schema to validate against ({e})") from None


def validate_pytorchjob(job: dict, version: str = K8S_VERSION) -> None:
    spec = job["spec"]
    if not spec.get("pytorchReplicaSpecs"):
        raise ManifestError("PyTorchJob: spec.pytorchReplicaSpecs is empty")
    for role, replica in spec["pytorchReplicaSpecs"].items():
        validate_pod_template(replica["template"], version, f"PyTorchJob {role} template")
    elastic = spec.get("elasticPolicy") or {}
    if elastic and not 1 <= elastic["minReplicas"] <= elastic["maxReplicas"]:
        raise ManifestError("PyTorchJob: elasticPolicy needs 1 <= minReplicas <= maxReplicas")


def validate_trainjob(job: dict, version: str = K8S_VERSION) -> None:
    """Round-trip through the pydantic model, and check the pod patch's volumes and env against the pod schema."""
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob
    from pydantic import ValidationError

    try:
        TrainerV1alpha1TrainJob.from_dict(job)
    except ValidationError as e:
        raise ManifestError(f"TrainJob: {e.errors()[0]['msg']}") from None
    trainer = job["spec"]["trainer"]
    patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    pod = patch["template"]["spec"]["template"]["spec"]
    container = {
        "name": TRAINJOB_CONTAINER,
        "image": trainer["image"],
        "command": trainer["command"],
        "env": trainer.get("env", []),
        "volumeMounts": pod["containers"][0]["volumeMounts"],
    }
    if trainer.get("resourcesPerNode"):
        container["resources"] = trainer["resourcesPerNode"]
    validate_pod_template(
        {"spec": {"containers": [container], "volumes": pod["volumes"]}},
        version,
        "TrainJob pod (trainer + runtime patch)",
    )


def build_manifests(opts: K8sOptions, job_toml: str) -> dict[str, list[dict]]:
    """{'pytorchjob.yaml': [ConfigMap, PyTorchJob], 'trainjob.yaml': [ConfigMap, TrainJob]}, all validated."""
    check_options(opts)
    cm = config_map(opts, job_toml)
    _validate(cm, opts.k8s_version, "ConfigMap")
    pj = build_pytorchjob(opts)
    validate_pytorchjob(pj, opts.k8s_version)
    tj = build_trainjob(opts)
    validate_trainjob(tj, opts.k8s_version)
    return {"pytorchjob.yaml": [cm, pj], "trainjob.yaml": [cm, tj]}


def to_yaml(docs: list[dict]) -> str:
    import yaml

    return yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False)
