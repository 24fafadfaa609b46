"""The training loop every rank runs: build, shard, train with accumulation, evaluate, write metrics.

Loss normalisation: each optimizer step sees B·S target tokens in all. A rank's micro-batch loss is its summed token
loss × (data-parallel degree / (B·S)), so the data-parallel gradient average yields exactly the gradient of the mean
over all B·S tokens: accumulation k×b equals one batch of k·b, and any layout equals one process.
"""

from __future__ import annotations

import json
import time

import torch

from scaletrain.config.load import to_toml
from scaletrain.config.schema import JobConfig
from scaletrain.data import DistributedLoader, TokenWindows, load_tokens, split_stream
from scaletrain.models import build_model, init_weights
from scaletrain.monitor import JsonlSink, StepProgress, configure_logging, log
from scaletrain.parallel import apply_parallelism, build_mesh, dp_coordinates, init_distributed, pick_device_type
from scaletrain.train.job import Job, make_scaler
from scaletrain.train.optim import build_optimizer, build_scheduler
from scaletrain.train.preflight import resolve_job, run_dir
from scaletrain.train.step import evaluate, forward_backward, sum_over_ranks


def train(cfg: JobConfig) -> dict:
    """Run the job in this process (one rank of many, or alone); returns the run summary on every rank."""
    device_type = pick_device_type(cfg.run.device)
    rt = init_distributed(device_type, cfg.launch.collective_timeout_s)
    configure_logging(rt.rank, cfg.monitor.all_ranks_log)
    plan = resolve_job(cfg, rt.world_size)
    args, dims = plan.args, plan.dims
    seq, gb = cfg.data.seq_len, cfg.train.global_batch_size
    tokens_per_step = gb * seq
    out = run_dir(cfg)

    mesh = build_mesh(dims, device_type)
    model = build_model(args, "meta")
    model = apply_parallelism(model, dims, mesh, rt.device, cfg.parallel, cfg.precision,
                              init_fn=lambda m: init_weights(m, args, cfg.run.seed))
    optimizer = build_optimizer(model, cfg.train)
    scheduler = build_scheduler(optimizer, cfg.train)
    dp_rank, dp_size = dp_coordinates(dims, mesh)
    scaler = make_scaler(dims, cfg.precision.dtype, rt.device, cfg.precision.loss_scale_init,
                         cfg.precision.loss_scale_growth_interval)
    job = Job(model, optimizer, dims, mesh, rt.device, rt.rank, rt.world_size, dp_rank, cfg.precision.dtype,
              cfg.train.grad_clip, scaler)

    tokens = load_tokens(cfg.data, args.vocab_size, cfg.run.seed)
    if len(tokens) and int(tokens.max()) >= args.vocab_size:
        raise ValueError(f"data: token id {int(tokens.max())} >= model vocab_size {args.vocab_size}; "
                         f"check data.token_dtype or set model.vocab_size")
    train_tokens, val_tokens = split_stream(tokens, cfg.data.val_fraction)
    loader = DistributedLoader(TokenWindows(train_tokens, seq), gb, plan.micro_batch, dp_rank, dp_size,
                               cfg.run.seed)
    val_loader = DistributedLoader(TokenWindows(val_tokens, seq), gb, plan.micro_batch, dp_rank, dp_size,
                                   cfg.run.seed, shuffle=False)

    sink = None
    if rt.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.toml").write_text(to_toml(cfg))
        sink = JsonlSink(out / "metrics.jsonl")
    n_params = args.num_params()
    log.info("scaletrain: %s on %d %s rank(s), %s, %.2fM params, %d steps of %d x %d tokens, accumulation %d",
             cfg.model.name, rt.world_size, device_type, dims.describe(), n_params / 1e6, cfg.train.steps,
             gb, seq, plan.accumulation)
    progress = StepProgress(cfg.train.steps, 0, enabled=rt.rank == 0, bar=cfg.monitor.progress)

    loss_scale = dims.dp / tokens_per_step
    last_loss = float("nan")
    val_loss = None
    t_start = t_log = time.perf_counter()
    steps_since_log = 0
    for step in range(1, cfg.train.steps + 1):
        loss_sum = forward_backward(job, loader.next_step(), loss_scale)
        grad_norm = job.step()
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        steps_since_log += 1

        if step % cfg.monitor.log_interval == 0 or step == cfg.train.steps:
            last_loss = sum_over_ranks(loss_sum) / tokens_per_step
            now = time.perf_counter()
            step_time = (now - t_log) / steps_since_log
            tps = tokens_per_step / step_time
            t_log, steps_since_log = now, 0
            record = {"step": step, "loss": last_loss, "grad_norm": float(grad_norm), "lr": lr,
                      "step_time_s": step_time, "tokens_per_s": tps}
            if scaler is not None:
                record["loss_scale"] = float(scaler.get_scale())
            if sink:
                sink.write(record)
            progress.update(step, last_loss, tps)

        if step == cfg.train.steps or (cfg.train.eval_interval and step % cfg.train.eval_interval == 0):
            val_loss = evaluate(job, val_loader, cfg.train.eval_batches, tokens_per_step)
            if sink:
                sink.write({"step": step, "val_loss": val_loss})
            progress.message(f"step {step}: validation loss {val_loss:.4f}")

    elapsed = time.perf_counter() - t_start
    progress.close()
    summary = {"steps": cfg.train.steps, "final_loss": last_loss, "val_loss": val_loss, "elapsed_s": elapsed,
               "tokens_per_s": cfg.train.steps * tokens_per_step / elapsed, "world_size": rt.world_size,
               "layout": dims.describe(), "device": device_type, "params": n_params}
    if sink:
        sink.close()
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        log.info("done: loss %.4f, validation loss %.4f, %.1f s, outputs in %s", last_loss, val_loss, elapsed, out)
    return summary
