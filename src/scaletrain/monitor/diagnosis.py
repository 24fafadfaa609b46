"""Bottleneck diagnosis: rules over the measured step-time breakdown, each naming the bottleneck with the
evidence and a suggested fix. Input is what the run wrote (metric records, device samples, profiler top ops), so
the same rules run at the end of training and in `scaletrain report`.

Severity: "bottleneck" (the run is limited by this), "warning" (worth fixing), "info" (context, never a flag).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field


@dataclass
class Thresholds:
    data_wait_pct: float = 10.0
    comm_pct: float = 30.0
    straggler_pct: float = 15.0
    idle_util_pct: float = 30.0
    bubble_excess_pct: float = 10.0
    memory_headroom_pct: float = 50.0
    moe_imbalance: float = 2.0  # busiest expert's load over its fair share (an MoE model's moe_imbalance)


@dataclass
class Finding:
    rule: str
    severity: str
    title: str
    evidence: str
    suggestion: str
    ranks: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _timed(records: list[dict]) -> list[dict]:
    rows = [r for r in records if "time_data_s" in r and r.get("step_time_s")]
    if rows:
        # a run resumed on another world size: judge the layout it ends with (per-rank lists change length)
        ranks = len(rows[-1].get("busy_s_per_rank") or [])
        rows = [r for r in rows if len(r.get("busy_s_per_rank") or []) == ranks]
    return rows[1:] if len(rows) > 2 else rows  # the first window holds warm-up (allocation, bucket rebuild)


def throughput_unit(records: list[dict]) -> str:
    """What the run's throughput counts, from its records' `<unit>_per_s` key (tokens for causal-lm, images for an
    image task: train/loop.py names it after the task's unit); "tokens" when no record says."""
    for r in records:
        for key in r:
            if key.endswith("_per_s"):
                return key.removesuffix("_per_s")
    return "tokens"


# what speeds up a data-bound run, by what its task reads
_DATA_REMEDIES = {
    "tokens": "prefetch batches in background workers (pin memory, overlap with compute), pre-tokenize the "
    "dataset into a token file (data.source=tokens), or read from faster storage",
    "images": "decode in more threads (task.decode_workers), read more steps ahead (data.prefetch), store the "
    "images at the size the model takes (smaller files decode faster), or read from faster storage",
}
_ANY_DATA_REMEDY = "read more steps ahead in the background (data.prefetch), or read from faster storage"


def _med(values) -> float:
    values = list(values)
    return statistics.median(values) if values else 0.0


def persistent_stragglers(records: list[dict]) -> dict[int, tuple[int, int, float]]:
    """rank -> (first step, last step, largest ratio) over the records where the run's StragglerWatch named it
    (stragglers.py: monitor.straggler_ratio for monitor.straggler_steps steps)."""
    out: dict[int, tuple[int, int, float]] = {}
    for r in records:
        for rank, since in zip(r.get("stragglers") or [], r.get("straggler_since_step") or []):
            ratio = (r.get("straggler_ratios") or [0.0] * (rank + 1))[rank]
            first, _, worst = out.get(rank, (since, 0, 0.0))
            out[rank] = (min(first, since), int(r["step"]), max(worst, ratio))
    return out


def diagnose(
    records: list[dict],
    th: Thresholds | None = None,
    samples: dict[int, list[dict]] | None = None,
    top_ops: dict | None = None,
    pp_bubble_predicted: float | None = None,
) -> list[Finding]:
    """Findings for a run, most severe first. records: metrics.jsonl rows; samples: rank -> sampler rows."""
    th = th or Thresholds()
    rows = _timed(records)
    out: list[Finding] = []
    if rows:
        step = _med(r["step_time_s"] for r in rows)
        data = _med(r["time_data_s"] / r["step_time_s"] for r in rows)
        if data * 100 > th.data_wait_pct:
            out.append(
                Finding(
                    "data_loader_bound",
                    "bottleneck",
                    "Data-loader bound",
                    f"ranks wait {data:.0%} of each step for data (median {step * data * 1e3:.1f} ms of "
                    f"{step * 1e3:.1f} ms; threshold {th.data_wait_pct:g} %)",
                    _DATA_REMEDIES.get(throughput_unit(records), _ANY_DATA_REMEDY),
                )
            )

        n = len(rows[0].get("busy_s_per_rank") or [])
        if n > 1:
            busy = [_med(r["busy_s_per_rank"][i] for r in rows) for i in range(n)]
            med = statistics.median(busy)
            slow = max(range(n), key=lambda i: busy[i])
            spread = (busy[slow] - med) / med if med > 0 else 0.0
            streaks = persistent_stragglers(records)
            if (spread * 100 > th.straggler_pct and busy[slow] - med > 1e-3) or streaks:
                named = sorted(streaks) or [slow]
                evidence = (
                    f"rank {slow} is busy {busy[slow] * 1e3:.1f} ms per step against a median of {med * 1e3:.1f} ms "
                    f"(+{spread:.0%}; threshold {th.straggler_pct:g} %); the other ranks wait for it in the gradient "
                    f"collectives"
                )
                if streaks:
                    evidence += "; persistently slow: " + ", ".join(
                        f"rank {r} {ratio:.2f}x the others at steps {first}-{last}"
                        for r, (first, last, ratio) in sorted(streaks.items())
                    )
                who = ", ".join(str(r) for r in named)
                out.append(
                    Finding(
                        "straggler",
                        "bottleneck",
                        f"Straggling rank: rank {who}",
                        evidence,
                        f"check rank {who}'s device and host (clocks, thermal throttling, other processes, a slower "
                        f"link or NUMA placement), or replace that node",
                        named,
                    )
                )
            comm = _med(r["comm_s_per_rank"][slow] / r["step_time_s"] for r in rows)
        else:
            comm = _med(r["time_comm_s"] / r["step_time_s"] for r in rows)
        if comm * 100 > th.comm_pct:
            how = rows[-1].get("comm_measure", "")
            out.append(
                Finding(
                    "communication_bound",
                    "bottleneck",
                    "Communication bound",
                    f"{comm:.0%} of each step is gradient communication not hidden behind compute (measured on the "
                    f"slowest rank, which waits for nobody; method: {how}; threshold {th.comm_pct:g} %)",
                    "raise the micro-batch or accumulation so compute covers the reduction, use bigger DDP buckets "
                    "(parallel.ddp_bucket_cap_mb), reduce in bf16 (precision.reduce_dtype), or keep the "
                    "data-parallel group inside a node (HSDP)",
                )
            )

        measured = _med(r["pp_bubble_measured"] for r in rows if "pp_bubble_measured" in r)
        if pp_bubble_predicted is not None and any("pp_bubble_measured" in r for r in rows):
            if (measured - pp_bubble_predicted) * 100 > th.bubble_excess_pct:
                out.append(
                    Finding(
                        "pipeline_bubble",
                        "bottleneck",
                        "Pipeline bubble larger than predicted",
                        f"measured idle share {measured:.0%} against {pp_bubble_predicted:.0%} predicted for the "
                        f"schedule (threshold +{th.bubble_excess_pct:g} points)",
                        "more micro-batches (parallel.pp_microbatches), an interleaved or zero-bubble schedule "
                        "(parallel.pp_schedule), or cost-balanced stages (parallel.pp_balance=cost)",
                    )
                )

        cap = rows[-1].get("mem_capacity_bytes")
        peaks = rows[-1].get("peak_mem_bytes_per_rank") or []
        if cap and peaks:
            used = max(peaks) / cap
            if (1 - used) * 100 > th.memory_headroom_pct:
                out.append(
                    Finding(
                        "memory_headroom",
                        "warning",
                        "Memory headroom unused",
                        f"peak allocated memory is {max(peaks) / 1e9:.1f} GB of {cap / 1e9:.1f} GB ({used:.0%}) on "
                        f"the fullest rank",
                        f"a micro-batch about {max(int(0.85 / max(used, 1e-3)), 2)}x bigger likely fits "
                        f"(train.micro_batch_size), or turn activation checkpointing off",
                    )
                )

    diverged = [r for r in records if r.get("replica_check") == "diverged"]
    if diverged:
        ranks = sorted({rank for r in diverged for rank in r.get("diverging_ranks") or []})
        who = ", ".join(map(str, ranks))
        out.append(
            Finding(
                "replica_divergence",
                "bottleneck",
                f"Replicas diverged: rank {who}",
                f"rank {who} held weights that differ from their data-parallel replicas' at "
                f"{len(diverged)} check(s), first at step {diverged[0]['step']} (monitor.replica_check_interval)",
                "a silent error (device memory, a faulty core) or a non-deterministic rank: check that rank's "
                "device, replace the node and resume from a checkpoint saved before the first divergence",
                ranks,
            )
        )

    for rank, rs in sorted((samples or {}).items()):
        gpu = [s["util_pct"] for s in rs if s.get("kind") == "gpu"]
        if len(gpu) >= 3 and _med(gpu) < th.idle_util_pct:
            out.append(
                Finding(
                    "idle_rank",
                    "warning",
                    f"Idle GPU: rank {rank}",
                    f"median GPU utilisation {_med(gpu):.0f} % over {len(gpu)} samples (threshold "
                    f"{th.idle_util_pct:g} %)",
                    "the GPU waits on the host: look at data wait and Python overhead (torch.compile, larger "
                    "micro-batches)",
                    [rank],
                )
            )

    moe = [r for r in records if "moe_imbalance" in r]
    late = moe[len(moe) // 2 :]  # after the router and its balancing had half the run to settle
    if late and _med(r["moe_imbalance"] for r in late) > th.moe_imbalance:
        worst = max(late[-5:], key=lambda r: r["moe_imbalance"])
        expert, layer = int(worst["moe_busiest_expert"]), int(worst["moe_busiest_layer"])
        out.append(
            Finding(
                "expert_imbalance",
                "warning",
                f"Expert load imbalance: expert {expert} of layer {layer} gets {worst['moe_imbalance']:.1f}x its share",
                f"median busiest-expert load {_med(r['moe_imbalance'] for r in late):.2f}x the mean over the last "
                f"{len(late)} logged steps (threshold {th.moe_imbalance:g}x); dropped "
                f"{_med(r.get('moe_dropped_frac', 0.0) for r in late):.1%} of routed tokens",
                "raise model.bias_update_rate (aux-loss-free balancing) or set model.aux_loss_coef; under "
                "parallel.ep the busiest expert's rank sets the step time",
            )
        )

    if top_ops and top_ops.get("ops"):
        ops = top_ops["ops"][:5]
        listing = "; ".join(f"{o['name']} {o['share']:.0%}" for o in ops)
        out.append(
            Finding(
                "top_kernels",
                "info",
                f"Top operators by {top_ops.get('time', 'self')} time (rank {top_ops['rank']})",
                listing,
                "the profiler trace in profile/ shows where each runs on the timeline",
            )
        )
    order = {"bottleneck": 0, "warning": 1, "info": 2}
    return sorted(out, key=lambda f: order[f.severity])


def flagged(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity != "info"]
