"""Distributed checkpoints: DCP saves committed atomically with checksums, retention, resume in any layout."""

from typing import TYPE_CHECKING

from scaletrain.checkpoint.manifest import list_checkpoints, read_manifest, verify

if TYPE_CHECKING:
    from scaletrain.checkpoint.manager import CheckpointManager

__all__ = ["CheckpointManager", "list_checkpoints", "read_manifest", "verify"]


def __getattr__(name: str):
    # the manager needs torch; `scaletrain ckpt ls` reads manifests without it
    if name == "CheckpointManager":
        from scaletrain.checkpoint.manager import CheckpointManager

        return CheckpointManager
    raise AttributeError(f"module 'scaletrain.checkpoint' has no attribute {name!r}")
