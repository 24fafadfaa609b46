"""Loading a DCP checkpoint without running code from it.

torch.distributed.checkpoint (torch 2.13) reads a checkpoint's `.metadata` with a plain `pickle.load`
(`FileSystemReader.read_metadata`), and its default planner reads every non-tensor value with
`torch.load(..., weights_only=False)`: anyone who can write a checkpoint folder can make resume, verify or export
run arbitrary code, and checksums written next to the data do not stop them. Here both go through restricted
readers: the metadata unpickler admits only the classes torch itself writes into `.metadata`, and non-tensor values
are read with torch's `weights_only` unpickler. Anything else is refused with `UnsafeCheckpoint`, before it runs.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

METADATA_FILE = ".metadata"

# (module, name) pairs torch 2.13's DCP writes into `.metadata` (found by tracing find_class on checkpoints of
# every layout scaletrain saves: DDP, FSDP2, TP, PP): its own dataclasses, torch.Size, dtypes, layouts, paths.
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.layout's reducer: a lookup by name in a cache of layouts
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpoint(ValueError):
    """A checkpoint file asks to unpickle something that is not checkpoint metadata."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, where: str):
        super().__init__(file)
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch":  # dtypes pickle as attributes of torch (torch.float32): admit exactly those
            import torch

            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
        raise UnsafeCheckpoint(
            f"{self._where}: refuses to unpickle {module}.{name} (checkpoint metadata holds "
            f"only torch.distributed.checkpoint's own classes); this folder was not written by "
            f"scaletrain or was tampered with, do not load it"
        )


def read_dcp_metadata(stream, where: str):
    """Unpickle a DCP `.metadata` stream admitting only checkpoint metadata classes; UnsafeCheckpoint otherwise."""
    try:
        return _MetadataUnpickler(stream, where).load()
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # truncated or garbled pickle: report it as a bad checkpoint, not a traceback
        raise UnsafeCheckpoint(f"{where}: unreadable checkpoint metadata ({type(e).__name__}: {e})") from None


def check_metadata(path: Path) -> None:
    """Read every DCP metadata file of `path` (`.metadata`, rank-local `__N.metadata`) with the restricted
    unpickler: nothing it names is imported unless allowed. UnsafeCheckpoint if one holds anything else."""
    files = sorted(path.glob("*" + METADATA_FILE))
    if not files:
        raise UnsafeCheckpoint(f"{path.name}: no {METADATA_FILE} file; not a torch.distributed.checkpoint folder")
    for file in files:
        with open(file, "rb") as f:
            read_dcp_metadata(f, f"{path.name}/{file.name}")


def _reader_and_planner(path: Path):
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            file = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(file, "rb") as stream:
                metadata = read_dcp_metadata(stream, f"{path.name}/{Path(file).name}")
            # what torch's own read_metadata does after unpickling (torch 2.13)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            import torch

            try:  # torch's default reads these with weights_only=False, i.e. any pickle
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                why = next((line.strip() for line in str(e).splitlines() if "unsupported" in line.lower()), "")
                raise UnsafeCheckpoint(
                    f"{path.name}: refuses a non-tensor value of {read_item.dest_index.fqn!r} "
                    f"that is not plain data ({why or 'refused by the weights_only unpickler'})"
                ) from None
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element  # what the default uses (torch 2.13)

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeFileSystemReader(str(path)), SafeLoadPlanner()


def load_dcp(state: dict, path: Path, no_dist: bool = False) -> None:
    """`dcp.load(state, checkpoint_id=path)` in place, through the restricted readers above."""
    import torch.distributed.checkpoint as dcp

    check_metadata(path)  # one clear error here; the reader below refuses the same again if the file changes
    from torch.distributed.checkpoint.api import CheckpointException

    reader, planner = _reader_and_planner(path)
    try:
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=no_dist)
    except CheckpointException as e:  # DCP wraps each rank's error (a BaseException): surface our refusal as is
        for error, _ in e.failures.values():
            if isinstance(error, UnsafeCheckpoint):
                raise error from None
        raise
