"""Launchers: local ranks through the torchrun agent (local.py), Slurm, Kubernetes, MPI and containers. Each module
is imported on its own, so writing an sbatch script or a manifest never imports torch."""


def __getattr__(name: str):
    # `from scaletrain.launch import launch_local` still works; it imports the agent (and torch) only then
    if name == "launch_local":
        from scaletrain.launch.local import launch_local

        return launch_local
    raise AttributeError(f"module 'scaletrain.launch' has no attribute {name!r}")
