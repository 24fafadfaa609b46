"""Token streams: this Python's standard library sources as bytes, a flat token file, or synthetic tokens.

A source is a 1-D int64 tensor of token ids, split into a train head and a validation tail.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

from scaletrain.config.schema import DataConfig


def stdlib_files() -> list[Path]:
    """The .py files of this interpreter's standard library, in a fixed (sorted path) order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "__pycache__"}
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]  # prune: the test suites are most of the tree
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_bytes(max_bytes: int) -> bytes:
    """Concatenated stdlib sources, up to max_bytes, each file separated by a blank line."""
    out = bytearray()
    for path in stdlib_files():
        if len(out) >= max_bytes:
            break
        out += path.read_bytes() + b"\n\n"
    return bytes(out[:max_bytes])


def load_tokens(cfg: DataConfig, vocab_size: int, seed: int) -> torch.Tensor:
    """The whole token stream of the configured source (int64)."""
    if cfg.source == "stdlib":
        data = np.frombuffer(stdlib_bytes(cfg.max_bytes), dtype=np.uint8)
    elif cfg.source == "tokens":
        assert cfg.path is not None  # preflight refuses source=tokens without data.path
        data = np.fromfile(cfg.path, dtype=cfg.token_dtype)
    else:
        gen = torch.Generator().manual_seed(seed + 7919)
        return torch.randint(0, vocab_size, (cfg.synthetic_tokens,), generator=gen)
    return torch.from_numpy(data.astype(np.int64))


def split_stream(tokens: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    n_val = max(1, int(len(tokens) * val_fraction))
    return tokens[:-n_val], tokens[-n_val:]
