"""One typed parallel layout, shared by job resolution, parallel/, the planner, its pins and `scaletrain.setup()`.

A Layout says how many ranks each parallelism spans (dp_replicate x dp_shard x cp x tp x pp = the world size), how a
data-parallel rank's share of a step is cut (micro_batch x accumulation), and the memory and precision choices the
planner weighs. How each parallelism runs beyond its degree (cp method, FSDP resharding, ...) stays in the
[parallel] section of the job config (config/schema.py ParallelConfig).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scaletrain.config.schema import JobConfig, ParallelConfig

AC_MODES = ("none", "selective", "full")


class DataParallelMode(StrEnum):
    """How data parallelism is applied; the value is the name logs and JSON show."""

    SINGLE = "single"  # no data parallelism (one data-parallel rank)
    DDP = "ddp"  # replicated weights, gradients all-reduced
    FSDP = "fsdp"  # FSDP2: weights, gradients and optimizer states sharded
    HSDP = "hsdp"  # FSDP2 inside shard groups, replicated across them

    @classmethod
    def of(cls, dp_replicate: int, dp_shard: int, cp: int) -> DataParallelMode:
        """The one rule: sharding over more than one rank is FSDP (HSDP with replicas too); cp ranks join the FSDP
        shard group (they hold the same weights and each sees part of every sequence)."""
        if dp_shard * cp > 1:
            return cls.HSDP if dp_replicate > 1 else cls.FSDP
        return cls.DDP if dp_replicate > 1 else cls.SINGLE

    @property
    def sharded(self) -> bool:
        """FSDP2 holds the weights (FSDP or HSDP)."""
        return self in (DataParallelMode.FSDP, DataParallelMode.HSDP)


# Where each Layout choice lives in the job config (section, key): settings() writes these, pins read them.
CONFIG_KEYS: dict[str, tuple[str, str]] = {
    "dp_replicate": ("parallel", "dp_replicate"),
    "dp_shard": ("parallel", "dp_shard"),
    "tp": ("parallel", "tp"),
    "pp": ("parallel", "pp"),
    "cp": ("parallel", "cp"),
    "micro_batch": ("train", "micro_batch_size"),
    "ac": ("parallel", "activation_checkpoint"),
    "precision": ("precision", "dtype"),
    "schedule": ("parallel", "pp_schedule"),
    "virtual_stages": ("parallel", "pp_stages_per_rank"),
}


def config_key(name: str) -> str:
    """The dotted job-config key of Layout field `name` ("tp" -> "parallel.tp"), for messages."""
    section, key = CONFIG_KEYS[name]
    return f"{section}.{key}"


def given_in_config(cfg: JobConfig, name: str) -> bool:
    """Whether the user set the config key of Layout field `name` (in the TOML or as an override): pydantic's
    model_fields_set tells a value given from a default."""
    section, key = CONFIG_KEYS[name]
    return key in getattr(cfg, section).model_fields_set


@dataclass(frozen=True)
class Layout:
    """One way to lay a job out. world size = dp_replicate x dp_shard x cp x tp x pp.

    micro_batch x accumulation is what a data-parallel rank computes per optimizer step (with pp > 1, accumulation
    is the pipeline's micro-batches); setup() leaves them 1: the user's own loop decides.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    micro_batch: int = 1  # sequences per forward of a data-parallel rank
    accumulation: int = 1  # micro-batches per optimizer step per data-parallel rank
    ac: str = "none"  # activation checkpointing: none / selective / full
    precision: str = "fp32"  # compute dtype name (config/precisions.py)
    schedule: str = "none"  # pipeline schedule ("none" when pp == 1)
    virtual_stages: int = 1  # pipeline stages per rank (interleaved and V schedules)
    ep: int = 1  # expert-parallel degree: carved from the dp_shard ranks (not a factor of the world size)

    @classmethod
    def from_degrees(cls, parallel: ParallelConfig, world_size: int) -> Layout:
        """The degrees of `parallel` on `world_size` ranks, dp_shard=-1 filled with the rest; ValueError (one line
        naming the field) when they do not multiply to world_size. Other fields keep their defaults."""
        fixed = parallel.dp_replicate * parallel.tp * parallel.pp * parallel.cp
        if parallel.dp_shard == -1:
            if world_size % fixed:
                raise ValueError(
                    f"parallel: dp_replicate x tp x pp x cp = {fixed} does not divide the world size {world_size}; "
                    f"change parallel.dp_replicate/tp/pp/cp or the number of ranks"
                )
            dp_shard = world_size // fixed
        else:
            dp_shard = parallel.dp_shard
        if fixed * dp_shard != world_size:
            raise ValueError(
                f"parallel: dp_replicate x dp_shard x tp x pp x cp = {parallel.dp_replicate} x {dp_shard} x "
                f"{parallel.tp} x {parallel.pp} x {parallel.cp} = {fixed * dp_shard}, but the world size is "
                f"{world_size}; set parallel.dp_shard=-1 to fill it"
            )
        return cls(parallel.dp_replicate, dp_shard, parallel.tp, parallel.pp, parallel.cp, ep=parallel.ep)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def replica_ranks(self) -> int:
        """Ranks in one data-parallel replica: the world size over dp_replicate."""
        return self.world_size // self.dp_replicate

    def replica_of(self, rank: int) -> tuple[int, int]:
        """(replica, position in it) of `rank`: the mesh lays ranks out pp-major, then dp_replicate, then the
        rest (parallel/dims.py MESH_ORDER), so a replica's ranks are a pp-th of the world in each of pp blocks."""
        inner = self.dp_shard * self.cp * self.tp
        outer, within = divmod(rank, inner)
        stage, replica = divmod(outer, self.dp_replicate)
        return replica, stage * inner + within

    def rank_of(self, replica: int, position: int) -> int:
        """The rank at `position` of `replica` (the inverse of replica_of)."""
        inner = self.dp_shard * self.cp * self.tp
        stage, within = divmod(position, inner)
        return (stage * self.dp_replicate + replica) * inner + within

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def mode(self) -> DataParallelMode:
        return DataParallelMode.of(self.dp_replicate, self.dp_shard, self.cp)

    @property
    def grad_average(self) -> int:
        """Ranks the data-parallel gradient reduction averages over: dp x cp (each cp rank's loss covers a cp-th
        of its sequences, so the loss scale must count them for the average to be the gradient of the sum)."""
        return self.dp * self.cp

    def sizes(self) -> dict[str, int]:
        """Degree of every mesh dim, outermost first (parallel/dims.py MESH_ORDER)."""
        return {
            "pp": self.pp,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "cp": self.cp,
            "tp": self.tp,
        }

    def describe_mesh(self) -> str:
        """The degrees as the trainer logs them, e.g. 'fsdp (dp_shard=4)', 'hsdp (dp_replicate=2 x dp_shard=2)'."""
        used = [f"{k}={v}" for k, v in self.sizes().items() if v > 1] + ([f"ep={self.ep}"] if self.ep > 1 else [])
        if self.mode is DataParallelMode.SINGLE:  # no data parallelism: name only the model-parallel dims
            return " x ".join(used) if used else "single (one rank)"
        return f"{self.mode} ({' x '.join(used)})"

    def describe(self) -> str:
        """Short human form of the whole layout, e.g. 'fsdp 64 · mb 1x8 · ac full · bf16'."""
        parts = []
        mode = self.mode
        if mode is DataParallelMode.HSDP:
            parts.append(f"hsdp {self.dp_replicate}x{self.dp_shard}")
        elif mode is DataParallelMode.FSDP and self.dp_shard > 1:  # cp alone shards too, but is named below
            parts.append(f"fsdp {self.dp_shard}")
        elif mode is DataParallelMode.DDP:
            parts.append(f"ddp {self.dp_replicate}")
        if self.tp > 1:
            parts.append(f"tp {self.tp}")
        if self.cp > 1:
            parts.append(f"cp {self.cp}")
        if self.ep > 1:
            parts.append(f"ep {self.ep}")
        if self.pp > 1:
            v = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
            parts.append(f"pp {self.pp} {self.schedule}{v}")
        if not parts:
            parts.append("1 gpu")
        parts.append(f"mb {self.micro_batch}x{self.accumulation}")
        parts.append(f"ac {self.ac}")
        parts.append(self.precision)
        return " · ".join(parts)

    def settings(self) -> dict[str, dict[str, object]]:
        """The job-config values that run this layout, by section and key (typed, as JobConfig holds them).

        Sequence parallelism comes with tp > 1 (the planner's TP model assumes it); cp > 1 runs the all-gather
        method (parallel.cp_method=allgather), the one the planner's cp traffic models. Stages per rank are the
        schedule's default (parallel.pp_stages_per_rank), as the planner assumes.
        """
        parallel: dict[str, object] = {
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "tp": self.tp,
            "pp": self.pp,
        }
        if self.cp > 1:
            parallel["cp"] = self.cp
            parallel["cp_method"] = "allgather"
        if self.pp > 1:
            parallel["pp_schedule"] = self.schedule
        if self.ac != "none":
            parallel["activation_checkpoint"] = self.ac
        if self.tp > 1:
            parallel["sequence_parallel"] = True
        return {
            "parallel": parallel,
            "train": {
                "global_batch_size": self.micro_batch * self.accumulation * self.dp,
                "micro_batch_size": self.micro_batch,
            },
            "precision": {"dtype": self.precision},
        }

    def apply(self, cfg: JobConfig) -> JobConfig:
        """`cfg` running this layout: its settings() replace cfg's, everything else stays. ConfigError (one line
        naming the field) when the result is not a valid config."""
        from scaletrain.config.load import validate_config

        tree = cfg.model_dump()
        for section, values in self.settings().items():
            tree[section].update(values)
        return validate_config(tree)

    def as_overrides(self) -> str:
        """The same settings as `key=value` overrides, for people to read or paste
        (`scaletrain train CONFIG.toml <these>`); scaletrain itself applies a Layout with apply()."""

        def toml(value: object) -> str:
            return str(value).lower() if isinstance(value, bool) else str(value)

        return " ".join(
            f"{section}.{key}={toml(value)}"
            for section, values in self.settings().items()
            for key, value in values.items()
        )

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["world_size"] = self.world_size
        d["overrides"] = self.as_overrides()
        return d
