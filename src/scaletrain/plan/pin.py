"""Pinning the planner's search to what a job config sets: `scaletrain plan CONFIG.toml [key=value ...]`.

Every layout field the user set explicitly (in the TOML or as an override; plan/auto.py's explicit_keys tells
them from defaults) fixes that dimension of the search. When every dimension is fixed, the planner evaluates that
one layout, fitting or not (plan/report.py: evaluate_report).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from scaletrain.config import JobConfig
from scaletrain.plan.layout import AC_MODES, Layout, LayoutGrid, Workload

# config key -> Layout field it pins (train.global_batch_size pins the Workload instead)
PIN_KEYS: dict[str, str] = {
    "parallel.dp_replicate": "dp_replicate",
    "parallel.dp_shard": "dp_shard",
    "parallel.tp": "tp",
    "parallel.pp": "pp",
    "parallel.pp_schedule": "schedule",
    "parallel.activation_checkpoint": "ac",
    "train.micro_batch_size": "micro_batch",
    "precision.dtype": "precision",
}
# what must be pinned for the planner to evaluate one layout instead of searching (schedule: the config's own
# pp_schedule is what the trainer runs, set or not)
FULL_PIN = ("dp_replicate", "dp_shard", "tp", "pp", "micro_batch", "ac", "precision")
DEGREES = ("dp_replicate", "dp_shard", "tp", "pp")


class PinError(ValueError):
    """A pinned value no layout of this model and cluster can have; one line naming the config key."""


@dataclass(frozen=True)
class Pins:
    """Layout fields fixed by the user (Layout field name -> value), and the config key each came from."""

    values: dict[str, int | str] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)  # Layout field -> config key, for messages
    schedule: str = "1F1B"  # what the trainer runs when pp > 1 (the config's pp_schedule, set or not)
    stages_per_rank: int = 1

    def __bool__(self) -> bool:
        return bool(self.values)

    def get(self, name: str):
        return self.values.get(name)

    @property
    def complete(self) -> bool:
        return all(n in self.values for n in FULL_PIN)

    def key(self, name: str) -> str:
        return self.keys.get(name, name)

    def mask(self, grid: LayoutGrid) -> np.ndarray:
        """True for the rows of `grid` that agree with every pin."""
        from scaletrain.config.precisions import PRECISION_NAMES
        from scaletrain.plan.pipeline import schedule_code

        keep = np.ones(len(grid), dtype=bool)
        for name, value in self.values.items():
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
        return {self.key(k): v for k, v in self.values.items()}


def pins_from_config(cfg: JobConfig, given: set[str], world: int | None) -> Pins:
    """The pins of a job config: the layout keys in `given` (dotted keys the user set). dp_shard = -1 ("the rest")
    pins the value it resolves to once the world size and the other degrees are known, else nothing."""
    values: dict[str, int | str] = {}
    keys: dict[str, str] = {}
    for key, name in PIN_KEYS.items():
        if key not in given:
            continue
        section, attr = key.split(".")
        value = getattr(getattr(cfg, section), attr)
        if value is None or value == "auto":  # precision.dtype=auto: the planner chooses, as when not set
            continue
        values[name], keys[name] = value, key
    if values.get("dp_shard") == -1:
        del values["dp_shard"]
        others = [values.get(n) for n in ("dp_replicate", "tp", "pp")]
        if world is not None and all(isinstance(v, int) for v in others):
            rest = world // int(others[0]) // int(others[1]) // int(others[2])  # type: ignore[arg-type]
            if rest >= 1:
                values["dp_shard"] = rest
    return Pins(values, keys, cfg.parallel.pp_schedule, cfg.parallel.stages_per_rank)


def pinned_world(pins: Pins) -> int | None:
    """World size the pinned degrees give when all four are pinned."""
    if all(n in pins.values for n in DEGREES):
        return int(np.prod([int(pins.values[n]) for n in DEGREES]))
    return None


def check_pins(pins: Pins, work: Workload, world: int) -> None:
    """PinError (one line naming the config key and the fix) when no layout can have the pinned values."""
    a = work.args
    tp = pins.get("tp")
    if tp is not None:
        tp = int(tp)
        if a.n_heads % tp or not (a.n_kv_heads % tp == 0 or tp % a.n_kv_heads == 0):
            ok = [t for t in range(1, a.n_heads + 1) if a.n_heads % t == 0 and world % t == 0]
            ok = [t for t in ok if a.n_kv_heads % t == 0 or t % a.n_kv_heads == 0]
            raise PinError(
                f"{pins.key('tp')}: {tp} does not divide the model's {a.n_heads} attention heads "
                f"({a.n_kv_heads} KV heads); use one of {', '.join(map(str, ok))}"
            )
    pp = pins.get("pp")
    if pp is not None and int(pp) > a.n_layers:
        raise PinError(f"{pins.key('pp')}: {pp} pipeline stages for {a.n_layers} layers; use at most {a.n_layers}")
    product, named = 1, []
    for n in DEGREES:
        if n in pins.values:
            product *= int(pins.values[n])
            named.append(f"{pins.key(n)}={pins.values[n]}")
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
    mb = pins.get("micro_batch")
    if mb is not None and all(n in pins.values for n in DEGREES):
        dp = int(pins.values["dp_replicate"]) * int(pins.values["dp_shard"])
        if work.global_batch % (dp * int(mb)):
            raise PinError(
                f"{pins.key('micro_batch')}: {mb} x {dp} data-parallel ranks does not divide the global batch "
                f"of {work.global_batch}; change train.micro_batch_size or train.global_batch_size"
            )


def pinned_layout(pins: Pins, work: Workload) -> Layout:
    """The one layout a complete set of pins describes (the config's schedule when pp > 1)."""
    v = {n: pins.values[n] for n in FULL_PIN}
    dp = int(v["dp_replicate"]) * int(v["dp_shard"])
    pp = int(v["pp"])
    schedule = str(pins.values.get("schedule", pins.schedule)) if pp > 1 else "none"
    return Layout(
        dp_replicate=int(v["dp_replicate"]),
        dp_shard=int(v["dp_shard"]),
        tp=int(v["tp"]),
        pp=pp,
        cp=1,
        micro_batch=int(v["micro_batch"]),
        accumulation=work.global_batch // (dp * int(v["micro_batch"])),
        ac=str(v["ac"]),
        precision=str(v["precision"]),
        schedule=schedule,
        virtual_stages=pins.stages_per_rank if pp > 1 else 1,
    )


def distance(a: Layout, b: Layout) -> int:
    """How many layout choices differ between a and b (degrees, micro-batch, checkpointing, precision, schedule)."""
    return sum(getattr(a, n) != getattr(b, n) for n in (*FULL_PIN, "schedule"))
