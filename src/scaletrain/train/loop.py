"""The training loop every rank runs: build, shard, train with accumulation, evaluate, write metrics.

Loss normalisation: each optimizer step sees B·S target tokens in all. A rank's micro-batch loss is its summed token
loss × (data-parallel degree / (B·S)), so the data-parallel gradient average yields exactly the gradient of the mean
over all B·S tokens: accumulation k×b equals one batch of k·b, and any layout equals one process.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist

from scaletrain.checkpoint import CheckpointManager
from scaletrain.checkpoint.export import load_hf_weights
from scaletrain.config.load import to_toml
from scaletrain.config.schema import JobConfig
from scaletrain.data import DistributedLoader, TokenWindows, load_tokens, split_stream
from scaletrain.models import build_model, init_weights
from scaletrain.monitor import StepProgress, configure_logging, log
from scaletrain.monitor.session import TrainMonitor, open_sinks
from scaletrain.parallel import apply_parallelism, build_mesh, dp_coordinates, init_distributed, pick_device_type
from scaletrain.train.job import Job, make_scaler
from scaletrain.train.optim import build_optimizer, build_scheduler
from scaletrain.train.preemption import EXIT_REQUEUE, PreemptionWatch
from scaletrain.train.preflight import resolve_job, run_dir
from scaletrain.train.step import evaluate, forward_backward, sum_over_ranks
from scaletrain.train.watchdog import Watchdog


class NonFiniteError(RuntimeError):
    """The loss or gradient became NaN/Inf and the nan policy says stop."""


class RankAgreement:
    """Logical OR of per-rank flags over all ranks, so every rank takes the same branch (preemption, time-based
    checkpoint). The all-reduce started at the end of step k is awaited at the end of step k+1: its latency hides
    behind a step of compute instead of stalling every step, and decisions are taken one step late."""

    def __init__(self) -> None:
        self._pending: tuple | None = None

    def exchange(self, *flags: bool) -> tuple[bool, ...]:
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return tuple(bool(f) for f in flags)
        agreed = (False,) * len(flags)
        if self._pending is not None:
            work, buf = self._pending
            work.wait()
            agreed = tuple(bool(x) for x in buf.tolist())
        buf = torch.tensor([int(f) for f in flags], dtype=torch.int32)
        self._pending = (dist.all_reduce(buf, op=dist.ReduceOp.MAX, async_op=True), buf)
        return agreed

    def close(self) -> None:
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records after `step` (logged before a failure, about to be recomputed after the resume)."""
    if path.is_file():
        keep = [line for line in path.read_text().splitlines(keepends=True)
                if line.strip() and json.loads(line).get("step", 0) <= step]
        path.write_text("".join(keep))


def train(cfg: JobConfig, console: TextIO | None = None) -> dict:
    """Run the job in this process (one rank of many, or alone); returns the run summary on every rank.
    `console`: the terminal when stderr goes to a rank log (rank 0's progress and log lines go there too)."""
    device_type = pick_device_type(cfg.run.device)
    rt = init_distributed(device_type, cfg.launch.collective_timeout_s, cfg.launch.rdzv_endpoint)
    configure_logging(rt.rank, cfg.monitor.all_ranks_log, console)
    plan = resolve_job(cfg, rt.world_size)
    args, dims = plan.args, plan.dims
    seq, gb = cfg.data.seq_len, cfg.train.global_batch_size
    tokens_per_step = gb * seq
    out = run_dir(cfg)

    mesh = build_mesh(dims, device_type)
    model = build_model(args, "meta")
    model = apply_parallelism(model, dims, mesh, rt.device, cfg.parallel, cfg.precision,
                              init_fn=lambda m: init_weights(m, args, cfg.run.seed),
                              microbatches=plan.accumulation, seq_len=seq)
    optimizer = build_optimizer(model, cfg.train)
    scheduler = build_scheduler(optimizer, cfg.train)
    dp_rank, dp_size = dp_coordinates(dims, mesh)
    scaler = make_scaler(dims, cfg.precision.dtype, rt.device, cfg.precision.loss_scale_init,
                         cfg.precision.loss_scale_growth_interval)
    job = Job(model, optimizer, dims, mesh, rt.device, rt.rank, rt.world_size, dp_rank, cfg.precision.dtype,
              cfg.train.grad_clip, scaler)

    tokens = load_tokens(cfg.data, args.vocab_size, cfg.run.seed)
    # a backstop: preflight already scanned a token file before any rank started
    if len(tokens) and not 0 <= int(tokens.min()) <= int(tokens.max()) < args.vocab_size:
        raise ValueError(f"data: token ids {int(tokens.min())}..{int(tokens.max())} fall outside the model's "
                         f"vocabulary 0..{args.vocab_size - 1}; check data.token_dtype or set model.vocab_size")
    train_tokens, val_tokens = split_stream(tokens, cfg.data.val_fraction)
    loader = DistributedLoader(TokenWindows(train_tokens, seq), gb, plan.micro_batch, dp_rank, dp_size,
                               cfg.run.seed)
    val_loader = DistributedLoader(TokenWindows(val_tokens, seq), gb, plan.micro_batch, dp_rank, dp_size,
                                   cfg.run.seed, shuffle=False)

    ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else out / "checkpoints"
    ckpt = CheckpointManager(cfg.checkpoint, ckpt_root, rt.rank, rt.world_size,
                             {"layout": dims.describe(), "world_size": rt.world_size, "model": cfg.model.name,
                              "model_args": dataclasses.asdict(args)})
    if cfg.checkpoint.init_from_hf:
        load_hf_weights(model, Path(cfg.checkpoint.init_from_hf), args)
        log.info("initial weights from Hugging Face checkpoint %s", cfg.checkpoint.init_from_hf)
    start_step, skipped = 0, 0
    resumed = ckpt.restore(model, optimizer) if cfg.checkpoint.resume else None
    if resumed is not None:
        start_step, skipped = resumed["step"], resumed.get("skipped_steps", 0)
        scheduler.load_state_dict(resumed["scheduler"])
        loader.load_state_dict(resumed["loader"])
        if scaler is not None and resumed.get("scaler"):
            scaler.load_state_dict(resumed["scaler"])
        log.info("resumed from %s at step %d (saved by %s on %s rank(s))", resumed["_resumed_from"], start_step,
                 resumed["_saved_layout"], resumed["_saved_world_size"])

    sink = None
    if rt.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.toml").write_text(to_toml(cfg))
        if start_step:
            _truncate_metrics(out / "metrics.jsonl", start_step)
        sink = open_sinks(cfg.monitor, out, start_step)
    n_params = args.num_params()
    log.info("scaletrain: %s on %d %s rank(s), %s, %.2fM params, %d steps of %d x %d tokens, accumulation %d",
             cfg.model.name, rt.world_size, device_type, dims.describe(), n_params / 1e6, cfg.train.steps,
             gb, seq, plan.accumulation)
    if getattr(model, "pipeline", None) is not None:
        log.info("%s", model.pipeline.describe())
    progress = StepProgress(cfg.train.steps, start_step, enabled=rt.rank == 0, bar=cfg.monitor.progress,
                            console=console)
    mon = TrainMonitor(cfg.monitor, out, rt.rank, rt.world_size, rt.device, model,
                       getattr(args, "flops_per_token", lambda s: None)(seq), cfg.precision.dtype, start_step,
                       dims.describe())

    def trainer_state() -> dict:
        return {"scheduler": scheduler.state_dict(), "loader": loader.state_dict(), "skipped_steps": skipped,
                "scaler": scaler.state_dict() if scaler is not None else None}

    loss_scale = dims.dp / tokens_per_step
    last_loss = float("nan")
    val_loss = None
    t_start = t_log = time.perf_counter()
    steps_since_log = 0
    watchdog = Watchdog(out / "heartbeat", rt.rank, rt.world_size, cfg.launch.hang_timeout_s,
                        cfg.launch.collective_timeout_s)
    watchdog.completed(start_step)
    agreement = RankAgreement()
    with PreemptionWatch() as preemption, watchdog:
        for step in range(start_step + 1, cfg.train.steps + 1):
            watchdog.beat(step, "data")
            with mon.phase("data"):
                micro_batches = loader.next_step()
            watchdog.beat(step, "forward/backward")
            loss_sum = forward_backward(job, micro_batches, loss_scale, timer=mon.timer)
            watchdog.beat(step, "optimizer")
            with mon.phase("optimizer"):
                grad_norm = job.step(skip_nonfinite=cfg.train.nan_policy == "skip")
            if not torch.isfinite(grad_norm) and scaler is None:
                loss_now = sum_over_ranks(loss_sum) / tokens_per_step
                skipped += 1
                what = "loss" if not math.isfinite(loss_now) else "gradient norm"
                values = f"loss {loss_now:.6g}, gradient norm {float(grad_norm):.6g}"
                if cfg.train.nan_policy == "stop" or skipped > cfg.train.max_skipped_steps:
                    raise NonFiniteError(
                        f"step {step}: {what} is not finite ({values}; train.nan_policy={cfg.train.nan_policy}, "
                        f"{skipped} step(s) skipped); stopping: lower train.lr or set train.grad_clip")
                log.warning("step %d: %s is not finite (%s), update skipped (%d/%d)", step, what, values, skipped,
                            cfg.train.max_skipped_steps)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            steps_since_log += 1

            if step % cfg.monitor.log_interval == 0 or step == cfg.train.steps:
                watchdog.beat(step, "metrics")
                last_loss = sum_over_ranks(loss_sum) / tokens_per_step
                now = time.perf_counter()
                step_time = (now - t_log) / steps_since_log
                tps = tokens_per_step / step_time
                t_log, steps_since_log = now, 0
                record = {"step": step, "loss": last_loss, "grad_norm": float(grad_norm), "lr": lr,
                          "step_time_s": step_time, "tokens_per_s": tps}
                if scaler is not None:
                    record["loss_scale"] = float(scaler.get_scale())
                record = mon.on_log(record)  # MFU, rank-aggregated breakdown (all ranks take part)
                if sink:
                    sink.write(record)
                progress.update(step, last_loss, tps, mon.headline(record))
            # marked right after the metrics' collectives, so the steps a hang message calls done match metrics.jsonl
            watchdog.completed(step)

            if step == cfg.train.steps or (cfg.train.eval_interval and step % cfg.train.eval_interval == 0):
                watchdog.beat(step, "evaluation")
                val_loss = evaluate(job, val_loader, cfg.train.eval_batches, tokens_per_step)
                if sink:
                    sink.write({"step": step, "val_loss": val_loss})
                progress.message(f"step {step}: validation loss {val_loss:.4f}")

            watchdog.beat(step, "end-of-step agreement")
            stop, minutes_due = agreement.exchange(preemption.requested, ckpt.minutes_due())
            if stop:
                agreement.close()
                ckpt.save(step, model, optimizer, trainer_state(), sync=True)
                progress.close()
                log.warning("preempted (%s): checkpoint of step %d saved; exiting %d so the job is requeued",
                            preemption.signal_name or "signal on another rank", step, EXIT_REQUEUE)
                if sink:
                    sink.close()
                mon.close()
                raise SystemExit(EXIT_REQUEUE)
            last = step == cfg.train.steps
            watchdog.beat(step, "checkpoint")
            if (cfg.checkpoint.interval_steps and step % cfg.checkpoint.interval_steps == 0 and not last) \
                    or (minutes_due and not last):
                ckpt.save(step, model, optimizer, trainer_state())
            ckpt.poll(step)
            mon.step_end(step)
        agreement.close()
        if cfg.checkpoint.save_final:
            ckpt.save(cfg.train.steps, model, optimizer, trainer_state(), sync=True)
        ckpt.close()

    elapsed = time.perf_counter() - t_start
    progress.close()
    summary = {"steps": cfg.train.steps, "final_loss": last_loss, "val_loss": val_loss, "elapsed_s": elapsed,
               "tokens_per_s": cfg.train.steps * tokens_per_step / elapsed, "world_size": rt.world_size,
               "layout": dims.describe(), "device": device_type, "params": n_params}
    if sink:
        sink.close()
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        log.info("done: loss %.4f, validation loss %.4f, %.1f s, outputs in %s", last_loss, val_loss, elapsed, out)
    mon.close()  # stops sampling; rank 0 writes the diagnosis
    return summary
