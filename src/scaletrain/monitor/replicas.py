"""Silent-error check (`monitor.replica_check_interval`): every N steps, do the data-parallel replicas still hold
bit-identical weights? Each rank checksums the weights it holds; ranks holding the same piece of every weight
(replicas: DDP ranks, HSDP's replicate groups, context-parallel ranks) must agree, and a rank that does not is named.

Which ranks hold the same piece is read from the parameters themselves, not from the layout: a rank's "piece" is
the list of (name, global offset, local shape) of its parameters (a DTensor's offset comes from its mesh and
placements; a plain tensor is whole), so FSDP and TP shards and pipeline stages are compared only with their own
replicas. One all_gather_object of two integers per rank each N steps; the checksum reads the exact bits.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from scaletrain.monitor.progress import log


def _local(p: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The tensor this rank holds and its offset in the global tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return p.to_local(), tuple(offset)
    return p, (0,) * p.dim()


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().view(-1)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(width).to(torch.int64)


@torch.no_grad()
def weight_fingerprint(model: torch.nn.Module) -> tuple[str, int]:
    """(what this rank holds, a checksum of its exact bits): equal pieces of equal weights give equal checksums."""
    piece = hashlib.sha256()
    total = torch.zeros((), dtype=torch.int64)
    for i, (name, p) in enumerate(model.named_parameters()):
        local, offset = _local(p)
        piece.update(f"{name}:{offset}:{tuple(local.shape)};".encode())
        bits = _bits(local).cpu()
        if bits.numel() == 0:
            continue
        # position-weighted so swapped values count too; int64 wraps around, alike on every rank
        weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64) * (2 * i + 1)
        total += (bits * weights).sum() + bits.sum()
    return piece.hexdigest()[:16], int(total)


@dataclass(frozen=True)
class ReplicaVerdict:
    step: int
    groups: int  # sets of ranks that should agree (two ranks or more)
    diverging: list[int]  # ranks whose weights differ from their replicas' (both when only two disagree)

    def record(self) -> dict:
        return {
            "step": self.step,
            "replica_check": "diverged" if self.diverging else "ok",
            "replica_groups": self.groups,
            "diverging_ranks": self.diverging,
        }


def judge(step: int, fingerprints: list[tuple[str, int]]) -> ReplicaVerdict:
    """Group ranks by the piece they hold; in each group the ranks off the majority checksum diverge (a tie: all)."""
    groups: dict[str, list[int]] = {}
    for rank, (piece, _) in enumerate(fingerprints):
        groups.setdefault(piece, []).append(rank)
    diverging: list[int] = []
    compared = 0
    for ranks in groups.values():
        if len(ranks) < 2:
            continue
        compared += 1
        counts: dict[int, int] = {}
        for r in ranks:
            counts[fingerprints[r][1]] = counts.get(fingerprints[r][1], 0) + 1
        if len(counts) == 1:
            continue
        top = max(counts.values())
        majority = [c for c, n in counts.items() if n == top]
        keep = majority[0] if len(majority) == 1 else None  # a tie names every rank of the group
        diverging += [r for r in ranks if fingerprints[r][1] != keep]
    return ReplicaVerdict(step, compared, sorted(diverging))


class ReplicaCheck:
    """Every `interval` steps (0: off), compare the replicas' weights; every rank takes part."""

    def __init__(self, interval: int, model: torch.nn.Module, perturb: tuple[int, int] | None = None):
        self.interval, self.model = interval, model
        self.perturb = perturb  # (rank, step): a fault injected by tests ($SCALETRAIN_FAULTS), never by config
        self._warned = False

    def due(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0

    def check(self, step: int) -> ReplicaVerdict:
        rank = dist.get_rank() if dist.is_initialized() else 0
        if self.perturb is not None and self.perturb == (rank, step):
            with torch.no_grad():
                p = next(self.model.parameters())
                _local(p)[0].view(-1)[0] += 1e-3  # a flipped bit's worth of damage on one replica
        mine = weight_fingerprint(self.model)
        if dist.is_initialized() and dist.get_world_size() > 1:
            every: list = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
        else:
            every = [mine]
        verdict = judge(step, every)
        if verdict.diverging:
            log.warning(
                "replica check at step %d: rank(s) %s hold weights that differ from their data-parallel replicas' "
                "(silent data corruption or a non-deterministic rank); check that rank's device, or restart from "
                "the last checkpoint",
                step,
                ", ".join(map(str, verdict.diverging)),
            )
        elif verdict.groups == 0 and not self._warned:
            self._warned = True
            log.info("replica check: no two ranks hold the same weights in this layout; nothing to compare")
        return verdict
