"""Distributed checkpoints: DCP saves committed atomically with checksums, retention, resume in any layout."""

from scaletrain.checkpoint.manager import CheckpointManager
from scaletrain.checkpoint.manifest import list_checkpoints, read_manifest, verify

__all__ = ["CheckpointManager", "list_checkpoints", "read_manifest", "verify"]
