"""The loop every rank runs around the Trainer (trainer.py): resume, train step by step, log, evaluate,
checkpoint, and stop cleanly on preemption or a hang, leaving the run folder's outputs (config.toml,
metrics.jsonl, summary.json, checkpoints/, monitor/)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import torch.distributed as dist

from scaletrain.checkpoint import CheckpointManager
from scaletrain.checkpoint.export import load_hf_weights
from scaletrain.models.lora import lora_manifest
from scaletrain.config.load import to_toml
from scaletrain.config.schema import JobConfig
from scaletrain.exit_codes import EXIT_REQUEUE
from scaletrain.inference.samples import PromptSampler
from scaletrain.monitor import StepProgress, configure_logging, log
from scaletrain.monitor.faults import injected_perturbation, injected_stop
from scaletrain.monitor.replicas import ReplicaCheck
from scaletrain.monitor.run_record import begin_run
from scaletrain.monitor.session import MonitorContext, TrainMonitor
from scaletrain.monitor.sinks import RunEnd, TrackedRun, open_sinks
from scaletrain.parallel.compile import CompileProbe
from scaletrain.train.preemption import PreemptionWatch
from scaletrain.train.trainer import NonFiniteError, StepResult, Trainer
from scaletrain.train.watchdog import Watchdog

__all__ = ["NonFiniteError", "Paused", "fit", "train"]


class Paused(Exception):
    """fit() stopped at a step boundary because the launcher asked (launch.fault_tolerance=replicas: a refilled
    replica rejoins): the state of `step` is in a host-memory snapshot, which the next generation resumes from."""

    def __init__(self, step: int):
        super().__init__(f"paused after step {step}")
        self.step = step


class RankAgreement:
    """Logical OR of per-rank flags over all ranks, so every rank takes the same branch (preemption, time-based
    checkpoint). The all-reduce started at the end of step k is awaited at the end of step k+1: its latency hides
    behind a step of compute instead of stalling every step, and decisions are taken one step late."""

    def __init__(self) -> None:
        self._pending: tuple | None = None

    def exchange(self, *flags: bool) -> tuple[bool, ...]:
        import torch

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
        keep = [
            line
            for line in path.read_text().splitlines(keepends=True)
            if line.strip() and json.loads(line).get("step", 0) <= step
        ]
        path.write_text("".join(keep))


def open_checkpoints(trainer: Trainer, out: Path) -> CheckpointManager:
    cfg, rt = trainer.cfg, trainer.rt
    root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else out / "checkpoints"
    return CheckpointManager(
        cfg.checkpoint,
        root,
        rt.rank,
        rt.world_size,
        {
            "layout": trainer.layout.describe_mesh(),
            "world_size": rt.world_size,
            # a memory snapshot loads into another replica count of the same degrees (launch.fault_tolerance)
            "degrees": {**trainer.layout.sizes(), "ep": trainer.layout.ep},
            "model": cfg.model.name,
            "model_spec": trainer.spec.manifest(),
            "seed": cfg.run.seed,  # the init by name of weights a checkpoint leaves out (frozen): export remakes them
            **({"lora": lora_manifest(cfg.lora, trainer.spec, cfg.run.seed)} if cfg.lora.rank else {}),
        },
        start_writer=False,  # fit starts it after the first step: see async_writer.py
    )


def resume(trainer: Trainer, ckpt: CheckpointManager) -> int:
    """Start weights (Hugging Face import, then this run's newest good checkpoint); returns the step to go on from."""
    cfg = trainer.cfg
    if cfg.checkpoint.init_from_hf:
        load_hf_weights(trainer.model.module, Path(cfg.checkpoint.init_from_hf), trainer.spec)
        log.info("initial weights from Hugging Face checkpoint %s", cfg.checkpoint.init_from_hf)
    restored = ckpt.restore(trainer.model.module, trainer.job.optimizer) if cfg.checkpoint.resume else None
    trainer.job.weights_loaded()
    if restored is None:
        return 0
    trainer.load_state_dict(restored.trainer_state)
    log.info(
        "resumed from %s at step %d (saved by %s on %s rank(s))",
        restored.path,
        restored.step,
        restored.saved_layout,
        restored.saved_world_size,
    )
    return restored.step


class _Outputs:
    """Rank 0's run folder outputs and every rank's monitor, opened and closed together."""

    def __init__(self, trainer: Trainer, out: Path, start_step: int, console: TextIO | None):
        cfg, rt = trainer.cfg, trainer.rt
        self.out = out
        self.sink = None
        run = begin_run(out, rt.rank, start_step)  # a fresh run clears the last one's outputs first
        if rt.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.toml").write_text(to_toml(cfg))
            if start_step:
                _truncate_metrics(out / "metrics.jsonl", start_step)
            config = cfg.model_dump(mode="json", exclude_none=True)  # as config.toml holds it
            self.sink = open_sinks(cfg.monitor, TrackedRun(out, cfg.run.name, start_step, config))
        pipeline = trainer.model.pipeline
        unit = {"tokens": "tok", "images": "img"}.get(trainer.task.unit, trainer.task.unit)
        self.progress = StepProgress(
            cfg.train.steps, start_step, enabled=rt.rank == 0, bar=cfg.monitor.progress, console=console, unit=unit
        )
        context = MonitorContext(
            out,
            run,
            start_step,
            rt.rank,
            rt.world_size,
            rt.device,
            trainer.model.module,
            trainer.task.flops_per_unit(cfg, trainer.spec),
            cfg.precision.dtype,
            trainer.layout.describe_mesh(),
            pipeline_stages=tuple(trainer.model.stages),
            pp_bubble=pipeline.bubble if pipeline is not None else None,
        )
        self.monitor = TrainMonitor(cfg.monitor, context)

    def write(self, record: dict) -> None:
        if self.sink is not None:
            self.sink.write(record)

    def close(self, summary: dict | None = None, end: RunEnd = "finished") -> None:
        """Close everything; rank 0 writes summary.json when given one and tells the trackers how the run ended
        (stopped: preempted). No diagnosis when the run failed."""
        self.progress.close()
        if self.sink is not None:
            if summary is not None:
                self.out.joinpath("summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            self.sink.close(summary, end)
            if summary is not None:
                log.info(
                    "done: loss %.4f, validation loss %.4f, %.1f s, outputs in %s",
                    summary["final_loss"],
                    summary["val_loss"],
                    summary["elapsed_s"],
                    self.out,
                )
        self.monitor.close(with_diagnosis=end != "failed")  # stops sampling; rank 0 writes the diagnosis


class _LogWindow:
    """Step time and throughput since the previous log step."""

    def __init__(self) -> None:
        self.t0, self.steps, self.counted = time.perf_counter(), 0, 0.0

    def add(self, result: StepResult) -> None:
        self.steps += 1
        self.counted += result.count

    def record(self, trainer: Trainer, step: int, result: StepResult, outputs: _Outputs) -> float:
        loss = trainer.mean_loss(result.loss_sum, result.count)
        now = time.perf_counter()
        step_time = (now - self.t0) / self.steps
        tps = self.counted / (now - self.t0)  # the task's units (tokens for causal-lm) per second
        self.t0, self.steps, self.counted = now, 0, 0.0
        record = {
            "step": step,
            "loss": loss,
            "grad_norm": float(result.grad_norm),
            "lr": result.lr,
            "step_time_s": step_time,
            f"{trainer.task.unit}_per_s": tps,  # tokens_per_s for causal-lm, images_per_s for a classifier
        }
        record.update(trainer.job.step_metrics)  # the model's own (an MoE model's expert load)
        if trainer.cfg.launch.fault_tolerance == "replicas":  # the replicas that trained this step
            record["replicas"] = trainer.layout.dp_replicate
        if trainer.job.scaler is not None:
            record["loss_scale"] = float(trainer.job.scaler.get_scale())
        record = outputs.monitor.on_log(record)  # MFU, rank-aggregated breakdown (all ranks take part)
        outputs.write(record)
        outputs.progress.update(step, loss, tps, outputs.monitor.headline(record))
        return loss


def train(cfg: JobConfig, console: TextIO | None = None) -> dict:
    """Run the job in this process (one rank of many, or alone); returns the run summary on every rank.
    `console`: the terminal when stderr goes to a rank log (rank 0's progress and log lines go there too)."""
    trainer = Trainer.build(cfg)
    configure_logging(trainer.rt.rank, cfg.monitor.all_ranks_log, console)
    return fit(trainer, console)


class _CompileWatch:
    """parallel.compile on the progress line: the probe's decision (compile=auto) and how long the step that
    compiled the blocks took, which is about the compilation (the first step, or the first after the probe)."""

    def __init__(self, trainer: Trainer, start_step: int, probe: CompileProbe | None):
        self.trainer, self.probe = trainer, probe
        self.compiling_step = start_step + 1 if trainer.cfg.parallel.compile is True else None
        self.eager_step_s = 0.0
        self._t0 = 0.0

    def _clock(self) -> float:
        import torch

        if self.trainer.rt.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def before(self, step: int) -> None:
        if step == self.compiling_step:
            self._t0 = self._clock()

    def after(self, step: int) -> None:
        if step == self.compiling_step:
            took = self._clock() - self._t0
            before = f" (eager steps took {self.eager_step_s:.2f} s)" if self.eager_step_s else ""
            log.info("compile: step %d took %.1f s with the blocks' compilation%s", step, took, before)
        probe = self.probe
        if probe is None or not probe.timing(step):
            return
        eager = probe.observe(step, self._clock())
        if eager is None:
            return
        self.probe = None
        decision = probe.decide(self.trainer.slowest(eager))  # every rank decides alike
        log.info("%s", decision.describe())
        if decision.compile:
            self.trainer.model.compile_blocks(self.trainer.spec)
            self.compiling_step, self.eager_step_s = step + 1, decision.eager_step_s


def fit(
    trainer: Trainer,
    console: TextIO | None = None,
    compile_probe: CompileProbe | None = None,
    pause: Callable[[], bool] | None = None,
) -> dict:
    """Train `trainer` to train.steps with checkpoints, metrics, evaluation, preemption and hang detection.
    compile_probe: how parallel.compile=auto decides (default: CompileProbe's measured figures).
    pause: asked on every rank after each step (one rank's yes suffices, agreed a step later like preemption):
    True snapshots the step's state to host memory and raises Paused (the in-process launcher's rejoin)."""
    cfg, rt = trainer.cfg, trainer.rt
    out = cfg.run_dir()
    ckpt = open_checkpoints(trainer, out)
    start_step = resume(trainer, ckpt)
    outputs = _Outputs(trainer, out, start_step, console)
    compile_mode = {True: "compiled", False: "eager", "auto": "compile auto"}[cfg.parallel.compile]
    log.info(
        "scaletrain: %s on %d %s rank(s), %s, %.2fM params, %d steps of %s, accumulation %d, %s, %s",
        cfg.model.name,
        rt.world_size,
        rt.device.type,
        trainer.layout.describe_mesh(),
        trainer.spec.num_params() / 1e6,
        cfg.train.steps,
        f"{cfg.train.global_batch_size} x {cfg.data.seq_len} tokens"
        if trainer.task.unit == "tokens"
        else f"{cfg.train.global_batch_size} {trainer.task.unit}",
        trainer.layout.accumulation,
        cfg.precision.dtype + (f" + fp8 {cfg.precision.fp8}" if cfg.precision.fp8 != "none" else ""),
        compile_mode,
    )
    if cfg.parallel.compile == "auto" and compile_probe is None:
        compile_probe = CompileProbe(cfg.train.steps, start_step)
    compile_watch = _CompileWatch(trainer, start_step, compile_probe)
    if trainer.model.pipeline is not None:
        log.info("%s", trainer.model.pipeline.describe())
    if trainer.model.context is not None:
        log.info("%s", trainer.model.context.describe())
    last_loss, val_loss, counted = float("nan"), None, 0.0
    t_start = time.perf_counter()
    window = _LogWindow()
    watchdog = Watchdog(
        out / "heartbeat", rt.rank, rt.world_size, cfg.launch.hang_timeout_s, cfg.launch.collective_timeout_s
    )
    watchdog.completed(start_step)
    agreement = RankAgreement()
    mon = outputs.monitor
    stop_at = injected_stop()  # a test's stop at a fixed step (monitor/faults.py)
    replicas = ReplicaCheck(cfg.monitor.replica_check_interval, trainer.model.module, injected_perturbation())
    sampler = PromptSampler(
        cfg, trainer.spec, trainer.model.module, rt.rank, rt.device, pipelined=trainer.model.pipeline is not None
    )
    try:
        with PreemptionWatch() as preemption, watchdog:
            for step in range(start_step + 1, cfg.train.steps + 1):
                compile_watch.before(step)
                result = trainer.train_step(step, mon.timer, watchdog.beat)
                compile_watch.after(step)
                window.add(result)
                counted += result.count
                last = step == cfg.train.steps
                if step % cfg.monitor.log_interval == 0 or last:
                    watchdog.beat(step, "metrics")
                    last_loss = window.record(trainer, step, result, outputs)
                # marked right after the metrics' collectives, so the steps a hang message calls done match
                # metrics.jsonl
                watchdog.completed(step)
                if replicas.due(step):
                    watchdog.beat(step, "replica check")
                    outputs.write(replicas.check(step).record())
                if last or (cfg.train.eval_interval and step % cfg.train.eval_interval == 0):
                    watchdog.beat(step, "evaluation")
                    val_metrics = trainer.evaluate()
                    val_loss = val_metrics["val_loss"]
                    samples = sampler.answer()  # train.sample_prompts: a collective, answered on rank 0
                    outputs.write({"step": step, **val_metrics, **({"samples": samples} if samples else {})})
                    outputs.progress.message(f"step {step}: validation loss {val_loss:.4f}")
                watchdog.beat(step, "end-of-step agreement")
                stop, minutes_due, paused = agreement.exchange(
                    preemption.requested, ckpt.minutes_due(), pause is not None and pause()
                )
                stop = stop or step == stop_at
                if stop:
                    agreement.close()
                    ckpt.save(step, trainer.model.module, trainer.job.optimizer, trainer.state_dict(), sync=True)
                    log.warning(
                        "preempted (%s): checkpoint of step %d saved; exiting %d so the job is requeued",
                        preemption.signal_name or ("stop_step" if step == stop_at else "signal on another rank"),
                        step,
                        EXIT_REQUEUE,
                    )
                    raise SystemExit(EXIT_REQUEUE)
                watchdog.beat(step, "checkpoint")
                if paused and not last:
                    agreement.close()
                    ckpt.finish_pending()
                    ckpt.snapshot(step, trainer.model.module, trainer.job.optimizer, trainer.state_dict())
                    log.info("paused after step %d: its state is in host memory for the next generation", step)
                    raise Paused(step)
                if not last and (
                    (cfg.checkpoint.interval_steps and step % cfg.checkpoint.interval_steps == 0) or minutes_due
                ):
                    ckpt.save(step, trainer.model.module, trainer.job.optimizer, trainer.state_dict())
                elif not last and ckpt.memory_due(step):
                    ckpt.snapshot(step, trainer.model.module, trainer.job.optimizer, trainer.state_dict())
                ckpt.poll(step)
                if step == start_step + 1:
                    ckpt.start_writer()  # the first step (a restart's first row) had the cores to itself
                mon.step_end(step)
            agreement.close()
            if cfg.checkpoint.save_final:
                ckpt.save(cfg.train.steps, trainer.model.module, trainer.job.optimizer, trainer.state_dict(), sync=True)
            ckpt.close()
    except (SystemExit, Paused):  # preempted or paused: the state is saved, the outputs are whole
        outputs.close(end="stopped")
        raise
    except BaseException:
        outputs.close(end="failed")
        raise
    elapsed = time.perf_counter() - t_start
    summary = {
        "steps": cfg.train.steps,
        "final_loss": last_loss,
        "val_loss": val_loss,
        "elapsed_s": elapsed,
        f"{trainer.task.unit}_per_s": counted / elapsed,  # the task's units (tokens for causal-lm) of the steps here
        "world_size": rt.world_size,
        "layout": trainer.layout.describe_mesh(),
        "device": rt.device.type,
        "params": trainer.spec.num_params(),
    }
    outputs.close(summary)
    return summary
