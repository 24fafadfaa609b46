"""`scaletrain plan`: parses the flags (and a job config), calls the planner (scaletrain.plan) and prints its report
(plan/render.py)."""

from __future__ import annotations

import dataclasses
import json

import click
from click.core import ParameterSource

from scaletrain.cli.errors import fail


def _hf_shape(path: str):
    """(decoder shape, name) of a Hugging Face folder's architecture; the spec's one-line summary on stderr."""
    from scaletrain.config.errors import FieldError
    from scaletrain.models.registry import spec_selected_by

    try:
        spec = spec_selected_by("hf", path)
    except FieldError as e:
        fail(e.named("--hf") if e.field == "model.hf" else str(e))
    except ValueError as e:
        fail(str(e))
    click.echo(f"scaletrain: {spec.describe()}", err=True)
    return spec.shape(), spec.model_name


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("config_args", nargs=-1, metavar="[CONFIG.toml] [section.key=value ...]")
@click.option("--model", default="llama-8b", show_default=True, help="Built-in preset (see `scaletrain models`).")
@click.option("--params", "params_text", default=None, help="Custom Llama-shaped size instead, e.g. 70B or 1e12.")
@click.option(
    "--hf", "hf_path", default=None, help="Plan a local Hugging Face model folder's architecture (its config.json)."
)
@click.option(
    "--factory",
    default=None,
    help="Plan your own model from its trace: package.module:function returning (model, example_input).",
)
@click.option(
    "--trace",
    "use_trace",
    is_flag=True,
    help="Plan from a trace of the model (one micro-batch on fake tensors) instead of the decoder formulas.",
)
@click.option("--dim", type=int, default=None, help="Override the model's hidden size.")
@click.option("--layers", "n_layers", type=int, default=None)
@click.option("--heads", "n_heads", type=int, default=None)
@click.option("--kv-heads", "n_kv_heads", type=int, default=None)
@click.option("--ffn-dim", type=int, default=None)
@click.option("--vocab", "vocab_size", type=int, default=None)
@click.option(
    "--block",
    type=click.Choice(["llama", "gpt"]),
    default=None,
    help="Block the shape flags describe: llama (SwiGLU: 3 matrices of dim x ffn-dim; a GPT's 4h MLP is "
    "--ffn-dim 8h/3 at equal parameters) or gpt (Megatron-LM's GPT block: LayerNorm, 2 matrices of dim x ffn-dim, "
    "GELU, biases, as Megatron runs it).",
)
@click.option("--gpus", type=int, default=None, help="Number of GPUs (required without --cluster).")
@click.option("--gpu", default="h100-sxm", show_default=True, help="GPU type from the catalog.")
@click.option("--interconnect", default=None, help="INTRA[,INTER] links, e.g. nvlink4,ib-ndr (default: the GPU's).")
@click.option("--gpus-per-node", type=int, default=None)
@click.option("--cluster", "cluster_file", default=None, help="TOML cluster file (see docs/planner.md).")
@click.option("--calibration", default=None, help="Calibration TOML from `scaletrain bench`.")
@click.option("--seq-len", type=int, default=None, help="Tokens per sequence (default: min(8192, model max)).")
@click.option("--global-batch", type=int, default=None, help="Sequences per optimizer step (default max(256, gpus)).")
@click.option(
    "--doc-len",
    type=click.IntRange(min=1),
    default=None,
    help="data.packing=document: mean document length in tokens; attention is priced per document, not per row.",
)
@click.option(
    "--lora-rank",
    type=click.IntRange(min=0),
    default=None,
    help="lora.rank: a frozen base with LoRA adapters of this rank on the attention and MLP projections; only the "
    "adapters get gradients and optimizer states (a job config's [lora] otherwise; 0: full fine-tuning).",
)
@click.option(
    "--lora-quantize",
    type=click.Choice(["none", "nf4"]),
    default=None,
    help="lora.quantize with --lora-rank: 'nf4' plans QLoRA, the adapted projections' frozen base in 4-bit NF4 "
    "(a job config's [lora] otherwise).",
)
@click.option("--precision", "precisions", default="bf16,fp32", show_default=True, help="Compute dtypes to search.")
@click.option(
    "--fp8",
    type=click.Choice(["none", "tensorwise", "rowwise"]),
    default="none",
    show_default=True,
    help="precision.fp8: bf16 layouts run the blocks' matmuls at the GPU's fp8 rate (priced compiled on a GPU, as "
    "the trainer runs fp8 there).",
)
@click.option(
    "--compile/--eager",
    "compiled",
    default=False,
    show_default=True,
    help="parallel.compile: price compiled blocks (fused elementwise ops, no per-op dispatch) or eager ones.",
)
@click.option(
    "--ac",
    "ac_modes",
    default="none,selective,full",
    show_default=True,
    help="Activation checkpointing modes to search.",
)
@click.option("--schedules", default=None, help="Pipeline schedules to search (default: all).")
@click.option("--cp", "cp_text", default=None, help="Context-parallel degrees to search, e.g. 1,2,4 (default: auto).")
@click.option(
    "--ep",
    "ep_text",
    default=None,
    help="Expert-parallel degrees to plan for an MoE model, e.g. 1,8 (default: every one dividing its experts and "
    "the GPUs).",
)
@click.option(
    "--pp",
    "moe_pp",
    type=int,
    default=None,
    help="Pipeline stages of an MoE plan (default 1; dense plans search pp, a job config pins it).",
)
@click.option(
    "--moe-imbalance",
    type=float,
    default=1.0,
    show_default=True,
    help="Tokens the busiest expert-parallel rank receives, x its even share (MoE plans).",
)
@click.option("--top", type=int, default=10, show_default=True, help="Rows in the table.")
@click.option("--tokens", "tokens_text", default=None, help="Token budget for time, cost and energy, e.g. 15T.")
@click.option("--compare-gpus", default=None, help="GPU types to compare for --tokens, e.g. h100-sxm,l40s.")
@click.option("--usd-per-gpu-hour", type=float, default=None)
@click.option("--pue", type=float, default=None, help="Power usage effectiveness (default 1.3, a placeholder).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def plan(
    config_args,
    model,
    params_text,
    hf_path,
    factory,
    use_trace,
    dim,
    n_layers,
    n_heads,
    n_kv_heads,
    ffn_dim,
    vocab_size,
    block,
    gpus,
    gpu,
    interconnect,
    gpus_per_node,
    cluster_file,
    calibration,
    seq_len,
    global_batch,
    doc_len,
    lora_rank,
    lora_quantize,
    precisions,
    ac_modes,
    schedules,
    cp_text,
    ep_text,
    moe_pp,
    moe_imbalance,
    top,
    tokens_text,
    compare_gpus,
    usd_per_gpu_hour,
    pue,
    fp8,
    compiled,
    as_json,
) -> None:
    """Plan a training job: memory, step time, MFU, bubble and communication of every layout, ranked and
    explained. Example: `scaletrain plan --model llama-8b --gpus 64 --gpu h100-sxm --interconnect nvlink4,ib-ndr`.

    With a job config (`scaletrain plan my.toml parallel.tp=2`), its model, data.seq_len and every layout field it
    sets (parallel.dp_replicate/dp_shard/tp/pp/pp_schedule/activation_checkpoint, train.micro_batch_size,
    train.global_batch_size, precision.dtype) pin the search; when all are set, that one layout is evaluated and
    printed even if it does not fit, with the nearest faster layouts that do."""
    from scaletrain.plan import compare_gpus as compare
    from scaletrain.plan.inputs import (
        check_prices,
        check_range,
        cluster_for,
        parse_amount,
        search_options,
        split_list,
        workload_for,
    )
    from scaletrain.plan.layout import runs_compiled
    from scaletrain.plan.render import print_compare, print_plan
    from scaletrain.plan.report import DoesNotFit, compare_dict, plan_report

    shape_flags = {
        "--dim": dim,
        "--layers": n_layers,
        "--heads": n_heads,
        "--kv-heads": n_kv_heads,
        "--ffn-dim": ffn_dim,
        "--vocab": vocab_size,
    }
    try:
        params = parse_amount(params_text, "--params")
        tokens = parse_amount(tokens_text, "--tokens")
        for flag, value in (
            ("--gpus", gpus),
            ("--gpus-per-node", gpus_per_node),
            ("--seq-len", seq_len),
            ("--global-batch", global_batch),
            *shape_flags.items(),
            ("--top", top),
        ):
            check_range(flag, value)
        check_prices(pue, usd_per_gpu_hour)
        opts = search_options(precisions, ac_modes, schedules, cp_text, top)
    except ValueError as e:
        fail(str(e))

    config = _job_config(config_args) if config_args else None
    shape = None
    config_model = False  # the job config's model is planned
    if config is not None:
        cfg = config
        from_flags = click.get_current_context().get_parameter_source("model") != ParameterSource.DEFAULT
        if params is None and not from_flags:
            shape, model = _config_shape(cfg), cfg.model.name
            config_model = True
        seq_len = seq_len if seq_len is not None else cfg.data.seq_len
        if global_batch is None and "global_batch_size" in cfg.train.model_fields_set:
            global_batch = cfg.train.global_batch_size
        if gpus is None and cluster_file is None:
            gpus = _config_world(cfg)
        opts = _family_limits(cfg, opts)
    try:
        cluster = cluster_for(gpu, gpus, interconnect, gpus_per_node, cluster_file, calibration, usd_per_gpu_hour, pue)
    except ValueError as e:
        fail(str(e))
    if factory is None and not use_trace:
        moe = _moe_spec(config if config_model else None, model, hf_path, params, ep_text)
        if moe is None and moe_pp is not None:
            fail("--pp: pins the pipeline degree of an MoE plan; a dense plan searches it (pin it in a job config)")
        if moe is not None:
            _plan_experts(
                moe,
                model,
                config if config_model else None,
                ep_text,
                moe_pp,
                cp_text,
                moe_imbalance,
                cluster,
                seq_len,
                global_batch,
                as_json,
            )
            return
    preset_traced = (
        config is None
        and hf_path is None
        and params is None
        and not any(v is not None for v in shape_flags.values())
        and _traced_preset(model)
    )
    if factory is not None or use_trace or preset_traced or (config_model and shape is None):
        # a model the decoder formulas do not describe (or asked for): planned from its trace
        _plan_from_trace(
            factory, hf_path, config if config_model else None, model, seq_len, global_batch, cluster, opts, as_json
        )
        return
    if hf_path is not None:
        shape, model = _hf_shape(hf_path)
    try:
        work = workload_for(
            model, params, shape_flags, seq_len, global_batch, cluster.gpus, shape, hf=hf_path is not None
        )
        work = dataclasses.replace(work, fp8=fp8, compile=runs_compiled(compiled, fp8, gpu), doc_len=doc_len)
        if block is not None and block != work.args.block:
            work = dataclasses.replace(work, args=_with_block(work.args, block), model_name=work.model_name + "*")
        work = dataclasses.replace(work, lora=_lora(config, lora_rank, lora_quantize))
    except ValueError as e:
        fail(str(e))
    pins = None
    if config is not None:
        pins = _pins(config, work, cluster.gpus)
        opts = _pinned_options(opts, pins)

    if compare_gpus:
        if tokens is None:
            fail("--compare-gpus: needs a token budget; add --tokens (e.g. --tokens 1T)")
        try:
            budgets = compare(
                work,
                list(split_list(compare_gpus)),
                cluster.gpus,
                tokens,
                opts,
                inter_link=cluster.inter_link.name if interconnect and "," in interconnect else None,
                usd_per_gpu_hour=usd_per_gpu_hour,
                pue=pue,
            )
        except ValueError as e:
            fail(str(e))
        if not any(b.fits for b in budgets):
            fail(f"{work.model_name} fits on none of {compare_gpus} with {cluster.gpus} GPUs; {budgets[0].note}")
        if as_json:
            click.echo(json.dumps(compare_dict(work, tokens, budgets), indent=2))
        else:
            print_compare(budgets, tokens, work)
        return

    try:
        if pins is not None and pins.complete:
            from scaletrain.plan.pin import pinned_layout
            from scaletrain.plan.report import evaluate_report

            report = evaluate_report(work, cluster, pinned_layout(pins, work), opts, pins)
        else:
            report = plan_report(work, cluster, opts, tokens)
    except DoesNotFit as e:
        pinned = f" with {', '.join(f'{k}={v}' for k, v in pins.to_dict().items())}" if pins else ""
        fail(f"{e}{pinned}" if not pins else f"no layout{pinned} fits; {e}")
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
        return
    print_plan(report)


def _with_block(args, block: str):
    """The shape with another block type (--block); ValueError in one line where that block cannot have it."""
    if block == "gpt" and args.n_kv_heads != args.n_heads:
        raise ValueError(
            f"--block gpt: the GPT block's attention is multi-head; set --kv-heads {args.n_heads} (= --heads)"
        )
    return dataclasses.replace(args, block=block)


def _lora(cfg, rank, quantize=None):
    """The planner's LoRA of --lora-rank (the default targets) or else the job config's [lora], with --lora-quantize
    or lora.quantize; None: full fine-tuning. ValueError naming lora.targets for a target the planner cannot place,
    or --lora-quantize without LoRA."""
    from scaletrain.plan.lora import lora_shape

    if rank is not None:
        shape = lora_shape(rank, quantize=quantize or "none") if rank else None
    elif cfg is None or not cfg.lora.rank:
        shape = None
    else:
        targets = list(cfg.lora.targets) if cfg.lora.targets else None
        shape = lora_shape(cfg.lora.rank, targets, cfg.lora.dropout, quantize or cfg.lora.quantize)
    if quantize == "nf4" and shape is None:
        raise ValueError("--lora-quantize: a 4-bit base is LoRA's (QLoRA); give --lora-rank R or lora.rank")
    return shape


def _job_config(config_args):
    """The JobConfig of `[CONFIG.toml] [key=value ...]` (its model_fields_set: the keys the user set); one line on a
    bad config."""
    from scaletrain.config import ConfigError, load_config
    from scaletrain.config.load import split_config_args

    path, overrides = split_config_args(config_args)
    try:
        return load_config(path, overrides)
    except ConfigError as e:
        fail(str(e))


def _traced_preset(name: str) -> bool:
    """True for a preset of a family the decoder formulas do not describe (a ViT, a diffusion UNet, ...): `plan
    --model NAME` plans it from its trace."""
    from scaletrain.models.registry import preset_spec, presets

    return name in presets() and preset_spec(name).shape() is None


def _config_shape(cfg):
    """The planner's decoder shape of the job config's model; None where the formulas do not describe it (the
    planner then traces it)."""
    from scaletrain.models.registry import model_spec

    try:
        spec = model_spec(cfg.model)
    except ValueError as e:
        fail(str(e))
    return spec.shape() if spec.planner_formulas else None


def _plan_from_trace(factory, hf_path, cfg, model, seq_len, global_batch, cluster, opts, as_json) -> None:
    """Trace the model (a factory's, an HF folder's, the job config's or a preset) once per compute dtype searched,
    plan its data-parallel layouts from the traces (plan/traced.py) and print them; one line on a user error."""
    from scaletrain.models.registry import model_spec, preset_spec, spec_selected_by
    from scaletrain.plan.render import print_traced_plan
    from scaletrain.plan.trace import factory_target, spec_target, trace_model
    from scaletrain.plan.traced import TRACED_AC_MODES, plan_traced, table_shape

    if cfg is not None:
        for key in ("tp", "pp", "cp"):
            if getattr(cfg.parallel, key) > 1:
                fail(f"parallel.{key}: a plan from a trace covers data-parallel layouts only; set parallel.{key}=1")
    ac_modes = tuple(a for a in opts.ac_modes if a in TRACED_AC_MODES)
    if not ac_modes:
        fail("--ac: a traced plan searches none and full checkpointing; add one of them")
    try:
        if factory is not None:
            target = factory_target(factory)
        else:
            if hf_path is not None:
                spec = spec_selected_by("hf", hf_path)
            elif cfg is not None:
                spec = model_spec(cfg.model)
                if not getattr(spec, "bound", True):  # a shape the data completes (a recommender's tables)
                    from scaletrain.tasks import task_for

                    task = task_for(cfg.task)
                    task.check_data(cfg, spec)
                    spec = task.bind_data(cfg, spec)
            else:
                spec = preset_spec(model)
            if not getattr(spec, "bound", True):
                fail(f"--model: {model}'s tables are sized by the data; plan a job config whose data.path names a "
                     f"prepared tabular folder, or a preset that names its columns (dlrm-criteo-kaggle)")  # fmt: skip
            seq = seq_len if seq_len is not None else min(8192, spec.max_seq_len or 8192)
            target = spec_target(spec, seq)
            tables = table_shape(spec, cfg.parallel.embedding_sharding if cfg is not None else "row")
        world = cluster.gpus
        batch = global_batch if global_batch is not None else world * -(-max(256, world) // world)
        traces = {p: trace_model(target, p) for p in opts.precisions}
        plan = plan_traced(traces, cluster, batch, ac_modes, opts.top, tables if factory is None else None)
    except ValueError as e:
        fail(str(e))
    if as_json:
        click.echo(json.dumps(plan.to_dict(), indent=2))
        return
    print_traced_plan(plan)


def _moe_spec(cfg, model, hf_path, params, ep_text):
    """The spec of the mixture-of-experts model to plan with expert parallelism (the job config's, else the preset
    --model names); None for a dense model, refused in one line when --ep asks for expert parallelism."""
    from scaletrain.models.registry import model_spec, preset_spec, presets, spec_selected_by

    if params is not None or (hf_path is not None and ep_text is None):  # --hf alone: the dense plan (or trace)
        if ep_text is not None:
            fail("--ep: plans MoE presets (--model moe-...), MoE job configs and --hf MoE folders; drop --params")
        return None
    try:
        if hf_path is not None:
            spec = spec_selected_by("hf", hf_path)
        else:
            spec = model_spec(cfg.model) if cfg is not None else preset_spec(model) if model in presets() else None
    except ValueError as e:
        fail(str(e))
    if spec is not None and spec.n_experts is not None and spec.splits_experts:
        return spec
    if spec is not None and spec.n_experts is not None and ep_text is not None:
        fail(f"--ep: {spec.model_name}'s experts are laid out in a way expert parallelism does not split; drop "
             f"--ep (it is planned as a dense model)")  # fmt: skip
    if ep_text is not None:
        name = spec.model_name if spec is not None and hf_path is not None else model
        fail(f"--ep: the {name} model is dense (no experts); drop --ep or plan an MoE preset (moe-...)")
    return None


def _plan_experts(spec, model, cfg, ep_text, pp, cp_text, imbalance, cluster, seq_len, global_batch, as_json):
    """Plan `pp` pipeline stages with FSDP over the GPUs of each and the experts of `spec` split over each
    expert-parallel degree asked (plan/experts.py); print the rows; one line for what it cannot plan."""
    from scaletrain.plan.experts import expert_params, expert_plan_row, parse_ep, render_expert_plan
    from scaletrain.plan.search import divisors

    if cp_text is not None:
        fail("--cp: an expert-parallel plan covers FSDP, pipelines and EP; drop --cp")
    if not imbalance >= 1.0:
        fail(f"--moe-imbalance: must be at least 1.0 (the even share); got {imbalance:g}")
    world = cluster.gpus
    name = spec.model_name if spec.selected_by == "hf" else model if cfg is None else cfg.model.name
    if cfg is not None:
        for key in ("dp_replicate", "tp", "cp"):
            if getattr(cfg.parallel, key) > 1:
                fail(f"parallel.{key}: an expert-parallel plan covers FSDP, pipelines and EP; set parallel.{key}=1")
        if ep_text is None and "ep" in cfg.parallel.model_fields_set:
            ep_text = str(cfg.parallel.ep)
        if pp is None and cfg.parallel.pp > 1:
            pp = cfg.parallel.pp
    pp = 1 if pp is None else pp
    if not 1 <= pp <= world or world % pp:
        fail(f"--pp: {pp} does not divide the {world} GPUs; pick a pp that divides them")
    dp = world // pp
    try:
        seq = seq_len if seq_len is not None else min(8192, spec.max_seq_len or 8192)
        stages = expert_params(spec, pp, seq)
        if ep_text is None:
            eps = [d for d in divisors(dp) if stages[0].n_experts % d == 0]
        else:
            eps = parse_ep(ep_text)
        batch = global_batch if global_batch is not None else max(256, world)
        micro_batches = -(-batch // dp)  # one sequence per micro-batch
        rows = [expert_plan_row(stages, ep, cluster, seq, micro_batches, imbalance) for ep in eps]
    except ValueError as e:
        fail(str(e))
    if as_json:
        click.echo(json.dumps({"model": name, "rows": [r.to_dict() for r in rows]}, indent=2))
        return
    click.echo(render_expert_plan(name, cluster, seq, micro_batches, rows))


def _config_world(cfg):
    """GPUs a job config runs on: launch.nproc_per_node x launch.nnodes when set, else the product of the four
    pinned degrees; None when neither says."""
    from scaletrain.plan.pin import pinned_world, pins_from_config

    if "nproc_per_node" in cfg.launch.model_fields_set and cfg.launch.nproc_per_node > 0:
        return cfg.launch.nproc_per_node * cfg.launch.nnodes
    return pinned_world(pins_from_config(cfg, None))


def _refuses(check, degree: int) -> bool:
    try:
        check(degree)
    except ValueError:
        return True
    return False


def _family_limits(cfg, opts):
    """`opts` without the degrees the job's model family or task refuses (no tensor-parallel plan, no pipeline
    cut, attention that cannot be split over ranks): `plan CONFIG` ranks only layouts `train CONFIG` runs."""
    from scaletrain.models.registry import model_spec
    from scaletrain.tasks import task_for

    try:
        spec, task = model_spec(cfg.model), task_for(cfg.task)
    except ValueError as e:
        fail(str(e))
    changes: dict = {}
    if _refuses(spec.check_tp, 2):  # a family-wide refusal; head counts are the search's own filter
        changes["max_tp"] = 1
    if _refuses(spec.check_pp, 2):
        changes["max_pp"] = 1
    if not (spec.supports_cp and task.sequences):
        changes["cp"] = (1,)
    return dataclasses.replace(opts, **changes) if changes else opts


def _pins(cfg, work, world):
    from scaletrain.plan.pin import PinError, check_pins, pins_from_config

    pins = pins_from_config(cfg, world)
    try:
        check_pins(pins, work, world)
    except PinError as e:
        fail(str(e))
    return pins


def _pinned_options(opts, pins):
    """Search options that cover every pinned value (a pinned precision, checkpointing mode, schedule or
    micro-batch is searched even where the flags would not search it)."""
    changes: dict = {"pins": pins}
    if pins.precision is not None:
        changes["precisions"] = (pins.precision,)
    if pins.ac is not None:
        changes["ac_modes"] = (pins.ac,)
    if pins.schedule is not None:
        changes["schedules"] = (pins.schedule,)
    if pins.micro_batch is not None:
        changes["max_micro_batch"] = max(opts.max_micro_batch, pins.micro_batch)
    return dataclasses.replace(opts, **changes)
