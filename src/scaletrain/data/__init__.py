"""Token sources (prepared shards, Megatron .bin/.idx, flat token files, stdlib, synthetic), mixing, and the
deterministic, resumable, rank-aware loader whose position is one number."""

from scaletrain.data.loader import Batch, DistributedLoader, TokenWindows, build_loaders
from scaletrain.data.sources import Dataset, open_datasets, split_tail, stdlib_bytes, stdlib_files
from scaletrain.data.stream import TokenStream

__all__ = [
    "Batch",
    "Dataset",
    "DistributedLoader",
    "TokenStream",
    "TokenWindows",
    "build_loaders",
    "open_datasets",
    "split_tail",
    "stdlib_bytes",
    "stdlib_files",
]
