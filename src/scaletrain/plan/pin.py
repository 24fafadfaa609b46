"""Pinning the planner's search to what a job config sets: `scaletrain plan CONFIG.toml [key=value ...]`.

Every layout field the user set explicitly (in the TOML or as an override; the typed config's model_fields_set
tells them from defaults, config/layout.py given_in_config) fixes that dimension of the search. When every dimension is fixed, the planner evaluates that
one layout, fitting or not (plan/report.py: evaluate_report).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np

from scaletrain.config import JobConfig
from scaletrain.config.layout import AC_MODES, Layout, config_key, given_in_config
from scaletrain.plan.layout import LayoutGrid, Workload

# what must be pinned for the planner to evaluate one layout instead of searching (schedule: the config's own
# pp_schedule is what the trainer runs, set or not)
FULL_PIN = ("dp_replicate", "dp_shard", "tp", "pp", "micro_batch", "ac", "precision")
DEGREES = ("dp_replicate", "dp_shard", "tp", "pp")


class PinError(ValueError):
    """A pinned value no layout of this model and cluster can have; one line naming the config key."""


@dataclass(frozen=True)
class Pins:
    """The Layout fields a job config fixes (None: searched), named as Layout names them; messages name the config
    key each comes from (config/layout.py config_key)."""

    dp_replicate: int | None = None
    dp_shard: int | None = None
    tp: int | None = None
    pp: int | None = None
    schedule: str | None = None
    ac: str | None = None
    micro_batch: int | None = None
    precision: str | None = None
    # what the trainer runs when pp > 1, pinned or not: the config's pp_schedule and its stages per rank
    trainer_schedule: str = "1F1B"
    stages_per_rank: int = 1

    def values(self) -> dict[str, int | str]:
        """The pinned Layout fields and their values."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("trainer_schedule", "stages_per_rank") and getattr(self, f.name) is not None
        }

    def __bool__(self) -> bool:
        return bool(self.values())

    @property
    def complete(self) -> bool:
        return all(getattr(self, n) is not None for n in FULL_PIN)

    def key(self, name: str) -> str:
        return config_key(name)

    def mask(self, grid: LayoutGrid) -> np.ndarray:
        """True for the rows of `grid` that agree with every pin."""
        from scaletrain.config.precisions import PRECISION_NAMES
        from scaletrain.plan.pipeline import schedule_code

        keep = np.ones(len(grid), dtype=bool)
        for name, value in self.values().items():
            if name == "ac":
                keep &= grid.ac == AC_MODES.index(str(value))
            elif name == "precision":
                keep &= grid.precision == PRECISION_NAMES.index(str(value))
            elif name == "schedule":
                keep &= (grid.pp == 1) | (grid.schedule == schedule_code(str(value)))
            else:
                keep &= getattr(grid, name) == int(value)
        return keep

    def to_dict(self) -> dict:
        """{config key: value} of every pin, as users wrote them."""
        return {self.key(k): v for k, v in self.values().items()}


def pins_from_config(cfg: JobConfig, world: int | None) -> Pins:
    """The pins of a job config: the Layout fields whose config keys the user set (config/layout.py
    given_in_config). dp_shard = -1 ("the rest") pins the value it resolves to once the world size and the other
    degrees are known, else nothing; precision.dtype=auto pins nothing (the planner chooses, as when not set)."""
    p = cfg.parallel
    chosen = {
        "dp_replicate": p.dp_replicate,
        "dp_shard": p.dp_shard,
        "tp": p.tp,
        "pp": p.pp,
        "micro_batch": cfg.train.micro_batch_size,
        "ac": p.activation_checkpoint,
        "precision": None if cfg.precision.dtype == "auto" else cfg.precision.dtype,
        "schedule": p.pp_schedule,
    }
    pins = Pins(
        **{name: value for name, value in chosen.items() if given_in_config(cfg, name)},
        trainer_schedule=p.pp_schedule,
        stages_per_rank=p.stages_per_rank,
    )
    if pins.dp_shard == -1:
        rest = None
        if world is not None and pins.dp_replicate is not None and pins.tp is not None and pins.pp is not None:
            rest = world // pins.dp_replicate // pins.tp // pins.pp
        pins = replace(pins, dp_shard=rest if rest is not None and rest >= 1 else None)
    return pins


def pinned_world(pins: Pins) -> int | None:
    """World size the pinned degrees give when all four are pinned."""
    degrees = [getattr(pins, n) for n in DEGREES]
    return int(np.prod(degrees)) if all(d is not None for d in degrees) else None


def check_pins(pins: Pins, work: Workload, world: int) -> None:
    """PinError (one line naming the config key and the fix) when no layout can have the pinned values."""
    a = work.args
    tp = pins.tp
    if tp is not None:
        if a.n_heads % tp or not (a.n_kv_heads % tp == 0 or tp % a.n_kv_heads == 0):
            ok = [t for t in range(1, a.n_heads + 1) if a.n_heads % t == 0 and world % t == 0]
            ok = [t for t in ok if a.n_kv_heads % t == 0 or t % a.n_kv_heads == 0]
            raise PinError(
                f"{pins.key('tp')}: {tp} does not divide the model's {a.n_heads} attention heads "
                f"({a.n_kv_heads} KV heads); use one of {', '.join(map(str, ok))}"
            )
    pp = pins.pp
    if pp is not None and pp > a.n_layers:
        raise PinError(f"{pins.key('pp')}: {pp} pipeline stages for {a.n_layers} layers; use at most {a.n_layers}")
    product, named = 1, []
    for n in DEGREES:
        degree = getattr(pins, n)
        if degree is not None:
            product *= degree
            named.append(f"{pins.key(n)}={degree}")
    if world % product:
        raise PinError(
            f"{' x '.join(named)}: their product {product} does not divide the {world} GPUs planned for; "
            f"change them or --gpus"
        )
    if pinned_world(pins) is not None and product != world:
        raise PinError(
            f"{' x '.join(named)}: their product {product} is not the {world} GPUs planned for; "
            f"set --gpus {product} or change them"
        )
    mb = pins.micro_batch
    if mb is not None and pinned_world(pins) is not None:
        dp = int(pins.dp_replicate or 1) * int(pins.dp_shard or 1)
        if work.global_batch % (dp * mb):
            raise PinError(
                f"{pins.key('micro_batch')}: {mb} x {dp} data-parallel ranks does not divide the global batch "
                f"of {work.global_batch}; change train.micro_batch_size or train.global_batch_size"
            )


def pinned_layout(pins: Pins, work: Workload) -> Layout:
    """The one layout a complete set of pins describes (the config's schedule when pp > 1)."""
    v = pins.values()
    if not pins.complete:
        missing = ", ".join(config_key(n) for n in FULL_PIN if n not in v)
        raise ValueError(f"{missing}: not pinned; the planner searches instead of evaluating one layout")
    dp_replicate, dp_shard, pp, mb = int(v["dp_replicate"]), int(v["dp_shard"]), int(v["pp"]), int(v["micro_batch"])
    schedule = (pins.schedule or pins.trainer_schedule) if pp > 1 else "none"
    return Layout(
        dp_replicate=dp_replicate,
        dp_shard=dp_shard,
        tp=int(v["tp"]),
        pp=pp,
        cp=1,
        micro_batch=mb,
        accumulation=work.global_batch // (dp_replicate * dp_shard * mb),
        ac=str(v["ac"]),
        precision=str(v["precision"]),
        schedule=schedule,
        virtual_stages=pins.stages_per_rank if pp > 1 else 1,
    )


def distance(a: Layout, b: Layout) -> int:
    """How many layout choices differ between a and b (degrees, micro-batch, checkpointing, precision, schedule)."""
    return sum(getattr(a, n) != getattr(b, n) for n in (*FULL_PIN, "schedule"))
