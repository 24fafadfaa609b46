"""`scaletrain launch slurm|k8s|container`: thin wrappers over scaletrain.launch. Every user error is one line
(`scaletrain: error: ...`, exit 2) before anything is written."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from scaletrain.cli.errors import fail


def _load(args: tuple[str, ...]):
    """The validated JobConfig from `[CONFIG.toml] [section.key=value ...]`, as `scaletrain train` reads it."""
    from scaletrain.config import ConfigError, load_config, split_config_args

    try:
        return load_config(*split_config_args(args))
    except ConfigError as e:
        fail(str(e))


def _prepare(cfg, nodes: int, gpus_per_node: int, ranks: int, output_dir: str | None = None):
    """Fit the config to the allocation and check it for that world size (one-line errors)."""
    from scaletrain.resolve import resolve_job

    try:
        if gpus_per_node == 0 and cfg.run.device == "auto":
            cfg.run.device = "cpu"  # no GPU requested: CPU ranks over gloo even where the nodes have GPUs
        if gpus_per_node > 0 and cfg.run.device == "cpu":
            raise ValueError(
                f"--gpus-per-node: {gpus_per_node} GPUs requested for run.device=cpu; "
                f"use --gpus-per-node 0 or run.device=cuda"
            )
        cfg.launch.nnodes = nodes
        cfg.launch.nproc_per_node = ranks
        cfg.run.output_dir = output_dir or str(Path(cfg.run.output_dir).resolve())
        resolve_job(cfg, nodes * ranks)
    except ValueError as e:
        fail(str(e).splitlines()[0])
    return cfg


@click.group()
def launch() -> None:
    """Launch a job on a scheduler or in a container: `launch slurm`, `launch k8s`, `launch container`."""


@launch.command("slurm", context_settings={"ignore_unknown_options": False})
@click.argument("args", nargs=-1)
@click.option("--nodes", type=int, default=1, show_default=True, help="Nodes; one agent per node.")
@click.option("--gpus-per-node", type=int, required=True, help="GPUs per node (--gres/--gpus-per-node); 0: CPU ranks.")
@click.option("--nproc-per-node", type=int, default=0, help="Ranks per node (default: one per GPU, or 2 CPU ranks).")
@click.option("--partition", default=None)
@click.option("--account", default=None)
@click.option("--qos", default=None)
@click.option("--time", "time_limit", default=None, help="Time limit, Slurm format (e.g. 4:00:00 or 1-00:00:00).")
@click.option("--constraint", default=None)
@click.option("--cpus-per-node", type=int, default=None, help="CPUs for each node's agent and its ranks.")
@click.option("--mem", default=None, help="Memory per node, Slurm format (e.g. 200G).")
@click.option("--job-name", default=None, help="Default: scaletrain-RUN_NAME.")
@click.option(
    "--signal-lead",
    type=int,
    default=120,
    show_default=True,
    help="Seconds before the time limit at which the job is told to checkpoint (SIGUSR1).",
)
@click.option("--port", type=int, default=None, help="Fixed rendezvous port (default: derived from the job id).")
@click.option("--sbatch", "extra_sbatch", multiple=True, help="Extra sbatch option, e.g. --sbatch=--exclusive.")
@click.option("--python", default=sys.executable, show_default=True, help="Python on the compute nodes.")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder for job.sbatch and job.toml (default: RUN_DIR/slurm).",
)
@click.option("--submit", is_flag=True, help="Submit with sbatch and print the job id.")
def slurm(
    args,
    nodes,
    gpus_per_node,
    nproc_per_node,
    partition,
    account,
    qos,
    time_limit,
    constraint,
    cpus_per_node,
    mem,
    job_name,
    signal_lead,
    port,
    extra_sbatch,
    python,
    out,
    submit,
) -> None:
    """Write (and with --submit, submit) an sbatch script: `launch slurm [CONFIG.toml] [key=value ...] --nodes N`."""
    from scaletrain.config import to_toml
    from scaletrain.launch.slurm import SlurmOptions, bash_syntax_ok, check_options, render_sbatch
    from scaletrain.launch.slurm import submit as sbatch_submit

    cfg = _load(args)
    opts = SlurmOptions(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        nproc_per_node=nproc_per_node,
        job_name=job_name or f"scaletrain-{cfg.run.name}",
        partition=partition,
        account=account,
        qos=qos,
        time=time_limit,
        constraint=constraint,
        cpus_per_node=cpus_per_node,
        mem=mem,
        signal_lead_s=signal_lead,
        port=port,
        extra_sbatch=list(extra_sbatch),
    )
    try:
        check_options(opts)
    except ValueError as e:
        fail(str(e))
    cfg = _prepare(cfg, nodes, gpus_per_node, opts.ranks_per_node())
    out = (out or cfg.run_dir() / "slurm").resolve()
    out.mkdir(parents=True, exist_ok=True)
    config_path, script_path = out / "job.toml", out / "job.sbatch"
    script = render_sbatch(config_path, opts, workdir=Path.cwd(), output=cfg.run_dir() / "slurm-%j.out", python=python)
    ok, msg = bash_syntax_ok(script)
    if not ok:  # a bug in the renderer, never the user's input: say so rather than write a broken script
        raise RuntimeError(f"rendered sbatch script fails bash -n: {msg}")
    config_path.write_text(to_toml(cfg))
    script_path.write_text(script)
    script_path.chmod(0o755)
    if not submit:
        click.echo(f"wrote {script_path} and {config_path}\nsubmit with: sbatch {script_path}")
        return
    try:
        job_id = sbatch_submit(script_path)
    except RuntimeError as e:
        fail(str(e))
    click.echo(job_id)


@launch.command("k8s", context_settings={"ignore_unknown_options": False})
@click.argument("args", nargs=-1)
@click.option("--image", required=True, help="Container image with scaletrain (see `launch container`).")
@click.option("--nodes", type=int, default=1, show_default=True, help="Pods (replicas); one agent per pod.")
@click.option("--gpus-per-node", type=int, required=True, help="nvidia.com/gpu per pod; 0: CPU ranks.")
@click.option("--nproc-per-node", type=int, default=0, help="Ranks per pod (default: one per GPU, or 2 CPU ranks).")
@click.option("--min-nodes", type=int, default=None, help="Elastic lower bound (default: --nodes, fixed size).")
@click.option("--max-restarts", type=int, default=3, show_default=True)
@click.option("--name", default=None, help="Job name (default: from run.name).")
@click.option("--namespace", default="default", show_default=True)
@click.option("--shm-size", default="16Gi", show_default=True, help="Memory-backed /dev/shm per pod.")
@click.option("--cpu", default=None, help="CPU per pod (quantity).")
@click.option("--memory", default=None, help="Memory per pod (quantity).")
@click.option("--pvc", default=None, help="PersistentVolumeClaim for run outputs and checkpoints.")
@click.option("--scheduler-name", default=None, help="Pod scheduler, e.g. runai-scheduler for Run:AI.")
@click.option("--runai-project", default=None, help="Run:AI project (the runai/queue label).")
@click.option("--env", "env", multiple=True, help="KEY=VALUE for every pod (e.g. NCCL_SOCKET_IFNAME=eth0).")
@click.option("--k8s-version", default=None, help="Kubernetes schema version to validate against.")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder for the manifests (default: RUN_DIR/k8s).",
)
def k8s(
    args,
    image,
    nodes,
    gpus_per_node,
    nproc_per_node,
    min_nodes,
    max_restarts,
    name,
    namespace,
    shm_size,
    cpu,
    memory,
    pvc,
    scheduler_name,
    runai_project,
    env,
    k8s_version,
    out,
) -> None:
    """Write a validated Kubeflow PyTorchJob and Trainer v2 TrainJob (each with its ConfigMap)."""
    from scaletrain.config import to_toml
    from scaletrain.launch.kubernetes import (
        K8S_VERSION,
        RUNS_MOUNT,
        K8sOptions,
        ManifestError,
        build_manifests,
        check_options,
        job_name_for,
        to_yaml,
    )

    cfg = _load(args)
    env_map = {}
    for item in env:
        key, eq, value = item.partition("=")
        if not eq:
            fail(f"--env: {item!r} must look like KEY=VALUE")
        env_map[key] = value
    opts = K8sOptions(
        image=image,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        nproc_per_node=nproc_per_node,
        name=name or job_name_for(cfg.run.name),
        namespace=namespace,
        min_nodes=min_nodes,
        max_restarts=max_restarts,
        shm_size=shm_size,
        cpu=cpu,
        memory=memory,
        pvc=pvc,
        scheduler_name=scheduler_name,
        runai_project=runai_project,
        env=env_map,
        k8s_version=k8s_version or K8S_VERSION,
    )
    try:
        check_options(opts)
    except ManifestError as e:
        fail(str(e))
    local_run_dir = cfg.run_dir().resolve()
    # inside the pod: outputs on the PVC when there is one, else the container's working folder
    cfg = _prepare(cfg, nodes, gpus_per_node, opts.ranks_per_node(), output_dir=RUNS_MOUNT if pvc else "runs")
    try:
        manifests = build_manifests(opts, to_toml(cfg))
    except ManifestError as e:
        fail(str(e))
    out = (out or local_run_dir / "k8s").resolve()
    out.mkdir(parents=True, exist_ok=True)
    for filename, docs in manifests.items():
        (out / filename).write_text(to_yaml(docs))
    click.echo(
        f"wrote {out / 'pytorchjob.yaml'} (training-operator v1) and {out / 'trainjob.yaml'} "
        f"(Trainer v2), validated against Kubernetes {opts.k8s_version}\n"
        f"apply with: kubectl apply -f {out / 'pytorchjob.yaml'}"
    )
    if not pvc:
        click.echo("note: without --pvc, checkpoints live in the pod and are lost when a pod is replaced", err=True)


@launch.command("container", context_settings={"ignore_unknown_options": False})
@click.argument("args", nargs=-1)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Build context folder (default: RUN_DIR/container).",
)
def container(args, out) -> None:
    """Write a Dockerfile and an Apptainer definition pinned to this Python, torch and CUDA."""
    from scaletrain.config import to_toml
    from scaletrain.launch.container import current_pins, write_build_context

    cfg = _load(args)
    run_dir = cfg.run_dir().resolve()
    cfg.run.output_dir = "runs"  # relative to the image's working folder; mount a volume there to keep outputs
    out = (out or run_dir / "container").resolve()
    pins = current_pins()
    write_build_context(out, to_toml(cfg), pins)
    click.echo(
        f"wrote a build context in {out}: Dockerfile, scaletrain.def, requirements.txt, job.toml, src/\n"
        f"pinned: python {pins.python}, torch {pins.torch}, CUDA {pins.cuda or 'none (CPU build)'}\n"
        f"docker:    docker build -t scaletrain-{cfg.run.name} {out} && "
        f"docker run --gpus all --ipc=host scaletrain-{cfg.run.name}\n"
        f"apptainer: cd {out} && apptainer build scaletrain.sif scaletrain.def && "
        f"apptainer run --nv scaletrain.sif"
    )
