"""What `scaletrain generate|eval PATH` points at, and what it was trained with.

PATH is a run folder (its newest committed checkpoint that verifies), one checkpoint (`step_NNNNNNNN`), or a
Hugging Face model folder (config.json + safetensors). A checkpoint is read into this one process with DCP
(checkpoint/export.py's loader, as `ckpt export` reads it). The tokenizer is the one the run's data was prepared
with (a prepared dataset's manifest records its folder), bytes for byte-level data (stdlib, synthetic), the model
folder's own, or `--tokenizer DIR`. Every refusal is a ValueError of one line naming PATH or the flag.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from scaletrain.checkpoint.manifest import MANIFEST, list_checkpoints, verify

if TYPE_CHECKING:
    import torch

    from scaletrain.config.schema import JobConfig
    from scaletrain.models.spec import ModelSpec

BYTES = "bytes"


@dataclass
class ModelSource:
    """A model to load: a committed checkpoint (with the run config found beside it) or a Hugging Face folder."""

    path: Path  # the checkpoint folder, or the Hugging Face model folder
    kind: str  # "checkpoint" or "hf"
    run_config: JobConfig | None = None  # the run's config.toml, when the checkpoint sits in its run folder

    def describe(self) -> str:
        return f"{self.kind} {self.path}"


def _read_run_config(run_dir: Path) -> JobConfig | None:
    from scaletrain.config import load_config
    from scaletrain.config.errors import ConfigError

    path = run_dir / "config.toml"
    if not path.is_file():
        return None
    try:
        return load_config(path)
    except (ConfigError, ValueError):
        return None


def _run_of_checkpoint(ckpt: Path) -> JobConfig | None:
    """The config of the run a checkpoint belongs to: RUN/checkpoints/step_N, or a checkpoint.dir beside it."""
    for folder in (ckpt.parent.parent, ckpt.parent):
        cfg = _read_run_config(folder)
        if cfg is not None:
            return cfg
    return None


def find_source(path: Path) -> ModelSource:
    """The model PATH holds; ValueError (one line) for a folder holding none, or a run without a checkpoint."""
    if not path.exists():
        raise ValueError(f"PATH: {path} does not exist; pass a run folder, a checkpoint folder or a Hugging Face model")
    if (path / MANIFEST).is_file():
        return ModelSource(path, "checkpoint", _run_of_checkpoint(path))
    cfg = _read_run_config(path)
    if cfg is not None or (path / "checkpoints").is_dir():
        root = Path(cfg.checkpoint.dir) if cfg is not None and cfg.checkpoint.dir else path / "checkpoints"
        for ckpt in list_checkpoints(root):
            if verify(ckpt, checksums=False).ok:
                return ModelSource(ckpt, "checkpoint", cfg or _run_of_checkpoint(ckpt))
        raise ValueError(
            f"PATH: the run {path} has no committed checkpoint to load (in {root}); train it with "
            f"checkpoint.save_final=true or checkpoint.interval_steps=N"
        )
    if (path / "config.json").is_file():
        return ModelSource(path, "hf")
    raise ValueError(
        f"PATH: {path} is not a run folder (config.toml, checkpoints/), a checkpoint (step_NNNNNNNN with "
        f"{MANIFEST}) or a Hugging Face model folder (config.json)"
    )


def load_weights(source: ModelSource) -> tuple[dict[str, torch.Tensor], ModelSpec]:
    """The model's whole weights in this process, in the family's own names, and its spec."""
    from scaletrain.checkpoint.export import load_full_model_state
    from scaletrain.models.hf.spec import HFSpec

    if source.kind == "hf":
        folder_spec = HFSpec.from_folder(str(source.path))
        model = folder_spec.build("cpu")
        folder_spec.init_weights(model, seed=0)  # the folder's safetensors
        return dict(model.state_dict()), folder_spec
    with warnings.catch_warnings():  # DCP says it loads in one process without a process group: that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        weights, spec = load_full_model_state(source.path)
    if spec is None:
        raise ValueError(
            f"PATH: {source.path} holds a model saved by scaletrain.setup() without a model spec; scaletrain cannot "
            f"rebuild it to run it"
        )
    return weights, spec


def _dataset_tokenizer(folder: str) -> str | None:
    from scaletrain.data.manifest import DatasetError, read_manifest

    try:
        info = read_manifest(folder).tokenizer
    except DatasetError:
        return None
    return BYTES if info.kind == BYTES else info.name


def _has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file()


def find_tokenizer(source: ModelSource, given: str | None) -> str:
    """`bytes` or the tokenizer folder to read: --tokenizer, the model folder's own, the run's data's."""
    if given is not None:
        if given != BYTES and not Path(given).exists():
            raise ValueError(f"--tokenizer: {given} does not exist; pass a tokenizer folder or `bytes`")
        return given
    if source.kind == "hf" and _has_tokenizer(source.path):
        return str(source.path)
    cfg = source.run_config
    if cfg is not None:
        data = cfg.data
        first = next((entry for _, entry in data.datasets()), None) if data.mix else None
        path = first.path if first is not None else data.path
        if data.source in ("stdlib", "synthetic") or (data.source == "auto" and not path):
            return BYTES
        if path:
            found = _dataset_tokenizer(path)
            if found is not None:
                return found
        hf_folder = cfg.model.family_keys().get("hf")
        if hf_folder and _has_tokenizer(Path(hf_folder)):
            return str(hf_folder)
    raise ValueError(
        f"--tokenizer: cannot tell which tokenizer {source.path} was trained with (no run config with a prepared "
        f"dataset beside it); pass --tokenizer DIR"
    )
