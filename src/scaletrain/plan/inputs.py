"""What `scaletrain plan` is asked, checked and built into the planner's types: the input ranges, the search
options, the workload and the cluster. Each check raises ValueError with one line naming the input as the command
spells it (--gpus, --ac, ...), before any search starts."""

from __future__ import annotations

import dataclasses
import math

from scaletrain.hardware.cluster import DEFAULT_PUE, Cluster
from scaletrain.models.spec import DecoderShape
from scaletrain.plan.layout import Workload
from scaletrain.plan.search import SearchOptions

# Input ranges: beyond them an answer means nothing, and the search (divisors of --gpus, one row per layout)
# would take minutes instead of well under a second.
PLAN_RANGES = {
    "--params": (1e8, 1e15, "1,000 T parameters, ~500x the largest trained models"),
    "--gpus": (1, 65536, "the most GPUs the planner's smallest-setup search tries"),
    "--gpus-per-node": (1, 65536, "at most --gpus"),
    "--seq-len": (2, 2**24, "16.8M tokens, beyond the longest trained contexts"),
    "--global-batch": (1, 2**24, "16.8M sequences, ~1000x the largest published batches"),
    "--dim": (1, 2**24, "a model dimension"),
    "--layers": (1, 1024, "~8x the deepest trained models (126 layers)"),
    "--heads": (1, 2**24, "a model dimension"),
    "--kv-heads": (1, 2**24, "a model dimension"),
    "--ffn-dim": (1, 2**24, "a model dimension"),
    "--vocab": (1, 2**24, "a model dimension"),
    "--top": (1, 1000, "rows in a table a person reads"),
    "--tokens": (1, 2**63 - 1, "a token count that fits in int64"),
}
# the model shape's inputs: the DecoderShape field each overrides
SHAPE_INPUTS = {
    "--dim": "dim",
    "--layers": "n_layers",
    "--heads": "n_heads",
    "--kv-heads": "n_kv_heads",
    "--ffn-dim": "ffn_dim",
    "--vocab": "vocab_size",
}


def check_range(flag: str, value: float | None) -> None:
    """ValueError naming the flag and its range when `value` is outside PLAN_RANGES[flag] or not finite."""
    if value is None:
        return
    lo, hi, why = PLAN_RANGES[flag]
    if not math.isfinite(value) or not lo <= value <= hi:
        show = (lambda x: f"{x:,}") if isinstance(hi, int) else (lambda x: f"{x:g}")
        raise ValueError(f"{flag}: must be {show(lo)} to {show(hi)} ({why}); got {show(value)}")


def parse_amount(text: str | None, flag: str) -> float | None:
    """'8e9', '8B', '15T', '500M' -> float, within PLAN_RANGES[flag]; None when not given."""
    if text is None:
        return None
    t = text.strip().upper().replace("_", "")
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(t[-1:], 1.0)
    try:
        value = float(t[:-1] if scale != 1.0 else t) * scale
    except ValueError:
        raise ValueError(f"{flag}: expected a number such as 8e9, 8B or 15T (got {text!r})") from None
    if not math.isfinite(value):
        raise ValueError(f"{flag}: must be a finite number (got {text!r})")
    if value <= 0:
        raise ValueError(f"{flag}: must be positive (got {text!r})")
    check_range(flag, value)
    return value


def split_list(text: str | None) -> tuple[str, ...]:
    """Comma-separated values; () when the option was not given."""
    return () if text is None else tuple(p.strip() for p in text.split(",") if p.strip())


def check_prices(pue: float | None, usd_per_gpu_hour: float | None) -> None:
    """ValueError unless the power usage effectiveness is >= 1 and the price is not negative (both finite)."""
    if pue is not None and not (math.isfinite(pue) and pue >= 1):
        raise ValueError(f"--pue: must be a finite number of at least 1.0 (got {pue})")
    if usd_per_gpu_hour is not None and not (math.isfinite(usd_per_gpu_hour) and usd_per_gpu_hour >= 0):
        raise ValueError(f"--usd-per-gpu-hour: must be a finite number, not negative (got {usd_per_gpu_hour})")


def search_options(
    precisions: str | None, ac_modes: str | None, schedules: str | None, cp: str | None, top: int
) -> SearchOptions:
    """The search over the given compute dtypes, checkpointing modes, pipeline schedules and context-parallel
    degrees (comma-separated; schedules and cp: None searches all), keeping `top` rows."""
    from scaletrain.config.precisions import PRECISION_NAMES
    from scaletrain.plan.layout import AC_MODES
    from scaletrain.plan.pipeline import NO_PIPELINE, schedule_code

    precs, acs = split_list(precisions), split_list(ac_modes)
    for p in precs:
        if p not in PRECISION_NAMES:
            raise ValueError(f"--precision: unknown dtype {p!r}; choose from {', '.join(PRECISION_NAMES)}")
    for a in acs:
        if a not in AC_MODES:
            raise ValueError(f"--ac: unknown mode {a!r}; choose from {', '.join(AC_MODES)}")
    if not precs or not acs:
        raise ValueError("--precision/--ac: give at least one value")
    sched = split_list(schedules)
    for name in sched:
        if schedule_code(name) == NO_PIPELINE:
            raise ValueError(f"--schedules: {name!r} is not a pipeline schedule")
    cps = None
    if cp:
        try:
            cps = tuple(int(x) for x in split_list(cp))
        except ValueError:
            raise ValueError(f"--cp: expected degrees such as 1,2,4 (got {cp!r})") from None
        if any(not 1 <= c <= PLAN_RANGES["--gpus"][1] for c in cps):
            raise ValueError(f"--cp: degrees must be 1 to {PLAN_RANGES['--gpus'][1]:,} (got {cp!r})")
    opts = SearchOptions(precisions=precs, ac_modes=acs, cp=cps, top=top)
    return dataclasses.replace(opts, schedules=sched) if sched else opts


def workload_for(
    model: str,
    params: float | None,
    shape_changes: dict[str, int | None],
    seq_len: int | None,
    global_batch: int | None,
    gpus: int,
    shape: DecoderShape | None = None,
    hf: bool = False,
) -> Workload:
    """The workload of a model: `shape` when given (a job config's model or, with hf, a Hugging Face folder's;
    named `model`), else a Llama-shaped model of `params` parameters, else the preset `model`; with the
    shape_changes (flag -> value, None: unchanged) applied. seq_len defaults to min(8192, the model's maximum),
    global_batch to max(256, gpus) sequences."""
    from scaletrain.models import preset_spec, presets
    from scaletrain.plan.shapes import decoder_shape_for_params

    if shape is not None:
        args, name = shape, model
    elif params is not None:
        args, name = decoder_shape_for_params(params), f"custom-{params / 1e9:.3g}b"
    else:
        preset = preset_spec(model).shape() if model in presets() else None
        if preset is None:
            raise ValueError(f"--model: unknown model {model!r}; choose one of {', '.join(presets())} or pass --params")
        args, name = preset, model
    changes = {SHAPE_INPUTS[flag]: v for flag, v in shape_changes.items() if v is not None}
    if changes and hf:
        raise ValueError(f"--hf: the shape comes from the folder's config.json; drop {'/'.join(SHAPE_INPUTS)}")
    if changes:  # each already within PLAN_RANGES
        args = dataclasses.replace(args, **changes)  # type: ignore[arg-type]
        name += "*"
        check_decoder(args)
    seq = seq_len if seq_len is not None else min(8192, args.max_seq_len)
    if seq > args.max_seq_len:
        args = dataclasses.replace(args, max_seq_len=seq)
    gb = global_batch if global_batch is not None else max(256, gpus)
    return Workload(name, args, seq, gb)


def check_decoder(shape: DecoderShape) -> None:
    """ValueError naming the flag when a changed shape is no decoder: heads that do not divide the model dimension,
    KV heads that do not divide the heads, an odd head size (rotary embeddings pair its channels)."""
    if shape.dim % shape.n_heads:
        raise ValueError(f"--heads: {shape.n_heads} does not divide the model dimension {shape.dim} (--dim)")
    if shape.n_heads % shape.n_kv_heads:
        raise ValueError(f"--kv-heads: {shape.n_kv_heads} does not divide the {shape.n_heads} attention heads")
    if shape.block == "llama" and shape.head_dim % 2:
        raise ValueError(f"--dim: head size {shape.head_dim} (--dim / --heads) must be even for rotary embeddings")


def cluster_for(
    gpu: str,
    gpus: int | None,
    interconnect: str | None,
    gpus_per_node: int | None,
    cluster_file: str | None,
    calibration: str | None,
    usd_per_gpu_hour: float | None,
    pue: float | None,
) -> Cluster:
    """The cluster: a cluster file's (its first `gpus`), else `gpus` GPUs of type `gpu` with the given links;
    prices overridden where given, then the calibration's measured curves applied. ValueError (ClusterFileError,
    CalibrationError) in one line."""
    from scaletrain.hardware import apply_calibration, load_calibration, load_cluster, make_cluster

    if cluster_file:
        cluster = load_cluster(cluster_file, gpus)
        if usd_per_gpu_hour is not None:
            cluster = dataclasses.replace(cluster, usd_per_gpu_hour=usd_per_gpu_hour)
        if pue is not None:
            cluster = dataclasses.replace(cluster, pue=pue)
    else:
        if gpus is None:
            raise ValueError("--gpus: required (or pass --cluster FILE.toml)")
        cluster = make_cluster(
            gpu, gpus, interconnect, gpus_per_node, usd_per_gpu_hour, DEFAULT_PUE if pue is None else pue
        )
    if calibration:
        cluster = apply_calibration(cluster, load_calibration(calibration))
    return cluster
