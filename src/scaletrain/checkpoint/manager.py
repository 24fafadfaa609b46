"""CheckpointManager: torch.distributed.checkpoint (DCP) saves of model + optimizer in any layout, plus the
trainer's own state as JSON, committed atomically, kept for the last k, verified and resumed from.

Model and optimizer go through `get_state_dict`/`set_state_dict`, so keys are the model's fully-qualified names
whatever wraps it (DDP, FSDP2, TP): a checkpoint saved by one layout and world size loads into another (DCP
reshards). Nothing in a checkpoint can run code when it is loaded: the trainer state is JSON, and DCP's pickled
metadata and non-tensor values go through restricted readers (safe_load.py).

A checkpoint that fails verification when resume looks at it is set aside (`step_N.corrupt-<time>`), so the
steps retrained after falling back are saved again instead of being skipped for an existing folder.

Async saves (the default) stay off the training step: async_writer.py stages, writes and commits in the
background; the training thread waits only for the staging copy before the next optimizer step and for a write
still running when the next save starts.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from scaletrain.checkpoint.async_writer import AsyncWriter
from scaletrain.checkpoint.memory import SNAPSHOT_INFO, MemorySnapshots, rank_file
from scaletrain.checkpoint.manifest import (
    commit,
    list_checkpoints,
    partial_dirs,
    set_aside,
    step_dir_name,
    verify,
)
from scaletrain.checkpoint.safe_load import load_dcp
from scaletrain.config.layout import Layout
from scaletrain.config.schema import CheckpointConfig
from scaletrain.models.naming import plain_param_name
from scaletrain.parallel.float8 import plain_weights
from scaletrain.parallel.pipeline import PipelinedModel

log = logging.getLogger("scaletrain")


def _rng_state() -> dict:
    state = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def _set_rng_state(state: dict) -> None:
    def decode(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    torch.set_rng_state(decode(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(decode(state["cuda"]))


# Flattened optimizer state: one key per parameter ("state.<name>.exp_avg", "param_groups.<name>.lr"), so ranks
# holding different parameters (pipeline stages) never collide on a key and any layout can load any other's.
# Frozen weights (a LoRA base) are left out: they come from the model's init at every start, so an adapter
# checkpoint holds the adapters alone (a full fine-tune has no frozen weights: nothing changes there).
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True)


def _load_options(model) -> StateDictOptions:
    """OPTIONS for loading; with frozen weights (LoRA) the model's state is loaded non-strictly, since the frozen
    weights it leaves out come from the model's init (every trainable key is still read: DCP fails on a missing one)."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return replace(OPTIONS, strict=False) if frozen else OPTIONS


_STAGE_PREFIX = re.compile(r"^((?:state|param_groups)\.)?\d+\.")


def _plain_key(key: str) -> str:
    """Checkpoint key in the plain single-process model's names: no pipeline-stage index (`0.`) and no wrapper
    components (DDP's `module.`, activation checkpointing's, compile's)."""
    return plain_param_name(_STAGE_PREFIX.sub(r"\1", key, count=1))


def _state_dicts(model, optimizer) -> tuple[dict, dict, dict[str, str], dict[str, str]]:
    """Model and optimizer state dicts keyed by plain names, plus the maps back to this layout's keys."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIONS)
    model_sd = plain_weights(model_sd)  # fp8: the high-precision weights, not torchao's float8 wrappers
    staged = isinstance(model, PipelinedModel)
    rename = _plain_key if staged else plain_param_name
    # ignore_frozen_params misses a frozen weight's second name (a tied output layer): leave every name of it out
    frozen = {rename(n) for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    model_sd = {k: v for k, v in model_sd.items() if rename(k) not in frozen}
    m_back = {rename(k): k for k in model_sd}
    o_back = {rename(k): k for k in optim_sd}
    return ({k: model_sd[v] for k, v in m_back.items()}, {k: optim_sd[v] for k, v in o_back.items()}, m_back, o_back)


def _local_values(sd: dict) -> dict:
    """A state dict with each DTensor replaced by the shard this rank holds (what a memory snapshot keeps)."""
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in sd.items()}


def _fill_local(state: dict, saved: dict, path: Path) -> None:
    """Copy a memory snapshot's shards (_local_values, this rank's file) into `state`'s tensors, which this same
    layout built: the same keys, each shard the same shape; plain values are taken as saved."""
    for part, sd in state.items():
        held = saved[part]
        if held.keys() != sd.keys():
            missing, extra = sorted(sd.keys() - held.keys()), sorted(held.keys() - sd.keys())
            raise RuntimeError(
                f"memory snapshot {path}: its {part} keys differ from this run's (missing {missing[:3]}, "
                f"unexpected {extra[:3]}); remove {path.parent} to resume from the disk checkpoints"
            )
        for k, v in sd.items():
            if isinstance(v, torch.Tensor):
                target = v.to_local() if isinstance(v, DTensor) else v
                if target.shape != held[k].shape:
                    raise RuntimeError(
                        f"memory snapshot {path}: {part} {k} holds a {tuple(held[k].shape)} shard, this rank's is "
                        f"{tuple(target.shape)}; remove {path.parent} to resume from the disk checkpoints"
                    )
                with torch.no_grad():
                    target.copy_(held[k])
            else:
                sd[k] = held[k]


@dataclass(frozen=True)
class Restored:
    """What a resume loaded: the trainer's own state and where it came from."""

    trainer_state: dict  # as saved: step, schedule, data position, ... (plain JSON)
    step: int
    path: Path
    saved_layout: str | None
    saved_world_size: int | None


SAME_RANKS, BY_REPLICA = 1, 2  # how a memory snapshot loads (CheckpointManager._snapshot_fits)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class CheckpointManager:
    def __init__(
        self, cfg: CheckpointConfig, root: Path, rank: int, world_size: int, info: dict, start_writer: bool = True
    ):
        self.cfg = cfg
        self.root = root
        self.rank = rank
        self.world_size = world_size
        self.info = info  # layout, world size, model: recorded in every manifest
        # (the write, rank 0: its commit, the step by which it must be done: checkpoint.async_commit_after_steps)
        self._pending: tuple[Future, Future | None, int] | None = None
        self._last_save_time = time.monotonic()
        self._saved_step: int | None = None  # the step this process last saved (or started saving)
        self._writer: AsyncWriter | None = None
        self._committer: ThreadPoolExecutor | None = None
        if cfg.async_save and self.enabled:
            self._writer = AsyncWriter(cfg.async_writer, start=start_writer)
            if rank == 0:
                self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scaletrain-ckpt-commit")
        self.memory = MemorySnapshots(root, cfg.memory_interval_steps) if cfg.memory_interval_steps > 0 else None
        if rank == 0:
            for stale in partial_dirs(root):  # a save that never committed (crash mid-save): never loadable
                log.warning("checkpoint: removing incomplete %s", stale)
                shutil.rmtree(stale, ignore_errors=True)
        _barrier()

    @property
    def enabled(self) -> bool:
        return self.cfg.interval_steps > 0 or self.cfg.interval_minutes > 0 or self.cfg.save_final

    def minutes_due(self) -> bool:
        """Rank-local: has interval_minutes passed since the last save? (the loop agrees across ranks)"""
        return (
            self.cfg.interval_minutes > 0
            and time.monotonic() - self._last_save_time >= 60.0 * self.cfg.interval_minutes
        )

    def save(self, step: int, model, optimizer, trainer_state: dict, sync: bool = False) -> None:
        """Save every rank's shard and the trainer state for `step`; async unless sync or configured sync."""
        self.finish_pending()
        if step == self._saved_step:
            return  # this process already saved this step (e.g. interval and preemption on the same step)
        self._saved_step = step
        final = self.root / step_dir_name(step)
        if final.exists() and self.rank == 0:  # an earlier run's: replaced atomically at commit, never skipped
            log.warning("checkpoint: %s exists from an earlier run; it will be replaced by this run's save", final.name)
        partial = self.root / (step_dir_name(step) + ".partial")
        partial.mkdir(parents=True, exist_ok=True)  # every rank: no barrier on the step path
        model_sd, optim_sd, _, _ = _state_dicts(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        (partial / f"rng_rank{self.rank}.json").write_text(json.dumps(_rng_state()))
        if self.rank == 0:
            (partial / "trainer.json").write_text(json.dumps({**trainer_state, "step": step}, indent=1))
        self._last_save_time = time.monotonic()
        writer = self._writer
        if sync or writer is None:
            dcp.save(state, checkpoint_id=str(partial))
            self._commit(partial, final, step)
            return
        write = writer.write(state, str(partial), optimizer)
        # rank 0's write ends after every rank's (DCP's coordinator gathers their results first): commit then
        committed = (
            self._committer.submit(self._commit_when_written, write, partial, final, step) if self._committer else None
        )
        self._pending = (write, committed, step + self.cfg.async_commit_after_steps)

    def _commit_when_written(self, write: Future, partial: Path, final: Path, step: int) -> None:
        write.result()
        self._commit_files(partial, final, step)

    def start_writer(self) -> None:
        """Start the async writer of a manager opened with start_writer=False (a collective on the first call)."""
        if self._writer is not None:
            self._writer.start()

    def writer_ready(self) -> float:
        """Block until the async writer process is up (it starts when the manager opens); returns seconds waited."""
        return self._writer.ready() if self._writer is not None else 0.0

    @property
    def staging_wait_s(self) -> float:
        """Seconds the training thread waited for async saves' staging copies, summed (0 without async saves)."""
        return self._writer.staging_wait_s if self._writer is not None else 0.0

    def poll(self, step: int) -> None:
        """After each step: settle an async save that is done (raising its error), and wait for one still running
        checkpoint.async_commit_after_steps steps after it started (a bound on what a failure can lose); the same
        step on every rank."""
        if self._pending is None:
            return
        write, committed, due = self._pending
        if step >= due or (write.done() and (committed is None or committed.done())):
            self.finish_pending()

    def finish_pending(self) -> None:
        """Wait for the async save in flight (staging, write, rank 0's commit); raises its error."""
        if self._writer is not None:
            self._writer.wait_staging()
        if self._pending is None:
            return
        write, committed, _ = self._pending
        self._pending = None
        write.result()
        if committed is not None:
            committed.result()

    def _commit(self, partial: Path, final: Path, step: int) -> None:
        _barrier()  # every rank's files are written
        if self.rank == 0:
            self._commit_files(partial, final, step)
        _barrier()

    def _commit_files(self, partial: Path, final: Path, step: int) -> None:
        """Rank 0: checksums and manifest, the atomic rename, retention."""
        manifest = commit(partial, final, {**self.info, "step": step, "time": time.time()})
        log.info("checkpoint: step %d saved to %s (%.1f MB)", step, final, manifest["bytes"] / 1e6)
        self._retain()

    def _retain(self) -> None:
        if self.cfg.keep <= 0:
            return
        for old in list_checkpoints(self.root)[self.cfg.keep :]:
            shutil.rmtree(old, ignore_errors=True)

    def latest_good(self) -> Path | None:
        """Rank 0: the newest checkpoint that verifies; newer ones that do not are reported and set aside."""
        for path in list_checkpoints(self.root):
            # the metadata check is cheap and guards against code in a pickle: always, checksums or not
            verdict = verify(path, checksums=self.cfg.verify_on_resume, metadata=True)
            if verdict.ok:
                return path
            aside = set_aside(path)
            log.warning("checkpoint: skipping %s: %s; set aside as %s", path.name, verdict.problem, aside.name)
        return None

    def memory_due(self, step: int) -> bool:
        return self.memory is not None and self.memory.due(step)

    def snapshot(self, step: int, model, optimizer, trainer_state: dict) -> None:
        """Keep `step`'s state in host memory (checkpoint.memory_interval_steps; memory.py), synchronously: each rank
        writes the shards it holds to its own tmpfs file, no checksums, no collective but the closing barrier."""
        assert self.memory is not None
        partial = self.memory.partial(step)
        partial.mkdir(parents=True, exist_ok=True)
        model_sd, optim_sd, _, _ = _state_dicts(model, optimizer)
        (partial / f"rng_rank{self.rank}.json").write_text(json.dumps(_rng_state()))
        if self.rank == 0:
            (partial / "trainer.json").write_text(json.dumps({**trainer_state, "step": step}, indent=1))
            (partial / SNAPSHOT_INFO).write_text(json.dumps({**self.info, "step": step}))
        local = {"model": _local_values(model_sd), "optim": _local_values(optim_sd)}
        torch.save(local, partial / rank_file(self.rank))
        _barrier()  # every rank's file is on tmpfs
        if self.rank == 0:
            self.memory.commit(step)

    def _snapshot_fits(self, saved: dict) -> int:
        """Rank 0: how the snapshot whose SNAPSHOT_INFO is `saved` loads into this run: SAME_RANKS (taken by this
        layout and world size: each rank reads its own file), BY_REPLICA (taken by this layout with another
        parallel.dp_replicate: each rank reads the file of its position in the first replica, whose shards are its
        own), or 0 (it does not: the disk checkpoints instead)."""
        here = {k: self.info.get(k) for k in ("layout", "world_size")}
        if {k: saved.get(k) for k in here} == here:
            return SAME_RANKS
        mine, theirs = (
            {k: v for k, v in (info.get("degrees") or {}).items() if k != "dp_replicate"} for info in (self.info, saved)
        )
        if mine and mine == theirs:
            return BY_REPLICA
        log.warning(
            "checkpoint: the host-memory snapshot of step %s was taken by %s on %s rank(s), this run is %s on %s: "
            "resuming from the disk checkpoints instead",
            saved.get("step"),
            saved.get("layout"),
            saved.get("world_size"),
            here["layout"],
            here["world_size"],
        )
        return 0

    def _snapshot_file(self, how: int, saved_replicas: int) -> str:
        """This rank's file of a snapshot that loads `how` (_snapshot_fits), taken with `saved_replicas` replicas."""
        if how == SAME_RANKS:
            return rank_file(self.rank)
        degrees = self.info["degrees"]
        _, position = Layout(**degrees).replica_of(self.rank)
        return rank_file(Layout(**{**degrees, "dp_replicate": saved_replicas}).rank_of(0, position))

    def _newest(self) -> tuple[int, int, int]:
        """Rank 0: (the step to resume from, how a memory snapshot of it loads (_snapshot_fits; 0: from disk), the
        snapshot's replica count); step -1 when there is none. A snapshot newer than the newest disk checkpoint
        wins, without reading the disk one's checksums."""
        snap = self.memory.newest() if self.memory is not None else None
        on_disk = list_checkpoints(self.root)
        newer = snap is not None and (not on_disk or snap[0] > int(on_disk[0].name.split("_")[1]))
        if snap is not None and newer:
            how = self._snapshot_fits(snap[2])
            if how:
                return snap[0], how, int((snap[2].get("degrees") or {}).get("dp_replicate", 1))
        path = self.latest_good()
        if path is None:
            return -1, 0, 0
        return int(path.name.split("_")[1]), 0, 0

    def restore(self, model, optimizer) -> Restored | None:
        """Load the newest good checkpoint, or a newer memory snapshot, into model and optimizer (any layout); None
        when there is none."""
        step = torch.tensor([-1, 0, 0], dtype=torch.int64)
        if self.rank == 0:
            step[0], step[1], step[2] = self._newest()
        if dist.is_initialized() and self.world_size > 1:
            dist.broadcast(step, src=0)
        if step[0].item() < 0:
            return None
        if step[1].item():
            assert self.memory is not None
            path = self.memory.dir / step_dir_name(int(step[0].item()))
            log.info("checkpoint: step %d is in host memory, newer than the disk checkpoints", int(step[0].item()))
        else:
            path = self.root / step_dir_name(int(step[0].item()))
        model_sd, optim_sd, m_back, o_back = _state_dicts(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if step[1].item():
            held = path / self._snapshot_file(int(step[1].item()), int(step[2].item()))
            _fill_local(state, torch.load(held, weights_only=True, mmap=True), path)
        else:
            load_dcp(state, path)
        set_state_dict(
            model,
            optimizer,
            model_state_dict={m_back[k]: v for k, v in state["model"].items()},
            optim_state_dict={o_back[k]: v for k, v in state["optim"].items()},
            options=_load_options(model),
        )
        trainer = json.loads((path / "trainer.json").read_text())
        manifest = json.loads((path / (SNAPSHOT_INFO if step[1].item() else "manifest.json")).read_text())
        rng = path / f"rng_rank{self.rank}.json"
        if manifest.get("world_size") == self.world_size and rng.is_file():
            _set_rng_state(json.loads(rng.read_text()))
        return Restored(trainer, int(trainer["step"]), path, manifest.get("layout"), manifest.get("world_size"))

    def close(self) -> None:
        """At the end of a run: the async save in flight finishes; the run's memory snapshots are freed."""
        try:
            self.finish_pending()
            if self.memory is not None and self.rank == 0:
                self.memory.clear()
        finally:
            if self._writer is not None:
                self._writer.close()  # kept: its staging_wait_s stays readable
            if self._committer is not None:
                self._committer.shutdown(wait=True)
                self._committer = None
