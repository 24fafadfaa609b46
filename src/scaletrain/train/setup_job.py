"""The Job `scaletrain.setup()` returns: the step mechanics of train/job.py plus what a user's own loop needs to
survive a restart: `save` / `load` (DCP through the CheckpointManager: atomic, verified, resharded across layouts
and world sizes, the user's own JSON state included) and a resumable data loader for a map-style dataset."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from scaletrain.checkpoint.manager import CheckpointManager
from scaletrain.config.schema import CheckpointConfig
from scaletrain.data.map_style import ResumableLoader
from scaletrain.models.spec import ModelSpec
from scaletrain.train.job import Job

SAVED_BY = "scaletrain.setup"


@dataclass(kw_only=True)
class SetupJob(Job):
    step_count: int = 0  # optimizer steps taken; `load` restores it, `save` names the checkpoint by it
    model_spec: ModelSpec | None = None  # recorded in the manifest when given, so `ckpt export --format hf` works
    _managers: dict = field(default_factory=dict, repr=False)

    def step(self, skip_nonfinite: bool = False) -> torch.Tensor:
        norm = super().step(skip_nonfinite)
        self.step_count += 1
        return norm

    def _manager(self, folder: str | Path) -> CheckpointManager:
        root = Path(folder).resolve()
        if root not in self._managers:
            info: dict[str, Any] = {
                "layout": self.layout.describe_mesh(),
                "world_size": self.world_size,
                "saved_by": SAVED_BY,
                "model_class": type(self.model).__name__,
            }
            if self.model_spec is not None:
                info["model_spec"] = self.model_spec.manifest()
            cfg = CheckpointConfig(async_save=False, keep=0, verify_on_resume=True)
            self._managers[root] = CheckpointManager(cfg, root, self.rank, self.world_size, info)
        return self._managers[root]

    def save(self, folder: str | Path, extra: dict | None = None) -> Path:
        """Save model, optimizer, loss scale, RNG and `extra` (plain JSON: numbers, strings, lists, dicts, e.g.
        `loader.state_dict()`) as `folder/step_<step_count>`, committed atomically. Every rank calls it; returns
        the checkpoint folder. A folder of the same step from an earlier run is replaced."""
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as e:
            raise ValueError(f"extra: must be plain JSON (numbers, strings, lists, dicts) to be saved: {e}") from None
        state: dict[str, Any] = {"extra": extra}
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state_dict()
        manager = self._manager(folder)
        manager.save(self.step_count, self.model, self.optimizer, state, sync=True)
        from scaletrain.checkpoint.manifest import step_dir_name

        return manager.root / step_dir_name(self.step_count)

    def load(self, folder: str | Path) -> dict | None:
        """Resume from the newest checkpoint under `folder` that verifies, whatever layout and world size saved it:
        model, optimizer, loss scale and step_count (RNG too on the same world size). Returns the `extra` it was
        saved with ({} when none), or None when `folder` holds no checkpoint (a fresh start)."""
        restored = self._manager(folder).restore(self.model, self.optimizer)
        if restored is None:
            return None
        self.step_count = restored.step
        if self.scaler is not None and "loss_scaler" in restored.trainer_state:
            self.scaler.load_state_dict(restored.trainer_state["loss_scaler"])
        return restored.trainer_state.get("extra") or {}

    def loader(
        self, dataset: Any, global_batch_size: int, *, shuffle: bool = True, seed: int = 0, **dataloader_kwargs: Any
    ) -> ResumableLoader:
        """A loader giving this rank its share (global_batch_size / dp_size samples) of every optimizer step of a
        map-style dataset; its position is one number, valid under any world size (data/map_style.py). Extra
        keyword arguments go to torch's DataLoader (num_workers, collate_fn, pin_memory, ...)."""
        return ResumableLoader(
            dataset, global_batch_size, self.dp_rank, self.dp_size, shuffle=shuffle, seed=seed, **dataloader_kwargs
        )
