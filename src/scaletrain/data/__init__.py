"""Token sources and the deterministic, resumable, rank-aware loader."""

from scaletrain.data.loader import Batch, DistributedLoader, TokenWindows
from scaletrain.data.sources import load_tokens, split_stream, stdlib_bytes, stdlib_files

__all__ = ["Batch", "DistributedLoader", "TokenWindows", "load_tokens", "split_stream", "stdlib_bytes", "stdlib_files"]
