"""`scaletrain report RUN_DIR`: one self-contained HTML file (inline SVG, inline CSS, no script, nothing fetched at
view time) with the run's plots and the bottleneck diagnosis. Every string that comes from a config, a log or a
file name goes through html.escape."""

from __future__ import annotations

import json
import math
from html import escape
from pathlib import Path

from scaletrain.monitor.diagnosis import Thresholds, diagnose
from scaletrain.monitor.metrics import read_jsonl
from scaletrain.monitor.session import read_samples, read_top_ops

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
PHASE_COLORS = {
    "data": "#d62728",
    "forward": "#1f77b4",
    "backward": "#2ca02c",
    "comm": "#ff7f0e",
    "optimizer": "#9467bd",
    "other": "#b0b0b0",
}
W, H, ML, MR, MT, MB = 560, 260, 64, 16, 30, 40


def _e(value) -> str:
    return escape(str(value), quote=True)


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _fmt(v) -> str:
    a = abs(v)
    if a >= 1e9:
        return f"{v / 1e9:g}G"
    if a >= 1e6:
        return f"{v / 1e6:g}M"
    if a >= 1e4:
        return f"{v / 1e3:g}k"
    return f"{v:.4g}"


def _frame(
    title: str,
    xlabel: str,
    ylabel: str,
    x0,
    x1,
    y0,
    y1,
    body,
    legend: list[tuple[str, str]],
    xticks: list[tuple[float, str]] | None = None,
) -> str:
    pw, ph = W - ML - MR, H - MT - MB

    def sx(x):
        return ML + (x - x0) / ((x1 - x0) or 1) * pw

    def sy(y):
        return MT + ph - (y - y0) / ((y1 - y0) or 1) * ph

    parts = [
        f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
        f'viewBox="0 0 {W} {H}" role="img" aria-label="{_e(title)}">',
        f'<text x="{W / 2}" y="18" text-anchor="middle" class="t">{_e(title)}</text>',
    ]
    for ty in _nice_ticks(y0, y1):
        parts.append(
            f'<line x1="{ML}" x2="{W - MR}" y1="{sy(ty):.1f}" y2="{sy(ty):.1f}" class="g"/>'
            f'<text x="{ML - 4}" y="{sy(ty) + 4:.1f}" text-anchor="end">{_e(_fmt(ty))}</text>'
        )
    for tx, label in xticks if xticks is not None else [(t, _fmt(t)) for t in _nice_ticks(x0, x1)]:
        parts.append(f'<text x="{sx(tx):.1f}" y="{H - MB + 14}" text-anchor="middle">{_e(label)}</text>')
    parts.append(
        f'<line x1="{ML}" x2="{W - MR}" y1="{MT + ph}" y2="{MT + ph}" class="a"/>'
        f'<line x1="{ML}" x2="{ML}" y1="{MT}" y2="{MT + ph}" class="a"/>'
    )
    parts.append(
        f'<text x="{ML + pw / 2}" y="{H - 6}" text-anchor="middle">{_e(xlabel)}</text>'
        f'<text transform="translate(12 {MT + ph / 2}) rotate(-90)" text-anchor="middle">{_e(ylabel)}</text>'
    )
    parts.append(body(sx, sy))
    lx = W - MR - 96  # legend in the top-right corner
    for i, (name, color) in enumerate(legend):
        y = MT + 10 + 14 * i
        parts.append(
            f'<rect x="{lx}" y="{y - 8}" width="10" height="10" fill="{color}"/>'
            f'<text x="{lx + 14}" y="{y + 1}">{_e(name)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def line_chart(title: str, series: list[tuple[str, list, list]], xlabel: str, ylabel: str, zero: bool = False) -> str:
    """SVG line chart; series: (name, xs, ys). Missing (None) and non-finite points are dropped."""
    series = [(n, [x for x, y in zip(xs, ys) if _ok(y)], [y for y in ys if _ok(y)]) for n, xs, ys in series]
    series = [s for s in series if s[1]]
    if not series:
        return f'<p class="empty">{_e(title)}: no data</p>'
    xs = [x for _, sx_, _ in series for x in sx_]
    ys = [y for _, _, sy_ in series for y in sy_]
    y0, y1 = (0.0 if zero else min(ys)), max(ys)
    pad = (y1 - y0) * 0.05 or abs(y1) * 0.05 or 1.0
    y0, y1 = (y0 if zero else y0 - pad), y1 + pad

    def body(sx, sy):
        out = []
        for i, (name, px, py) in enumerate(series):
            color = COLORS[i % len(COLORS)]
            pts = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(px, py))
            out.append(
                f'<polyline fill="none" stroke="{color}" stroke-width="1.8" points="{pts}">'
                f"<title>{_e(name)}</title></polyline>"
            )
            if len(px) <= 60:
                out += [
                    f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.2" fill="{color}">'
                    f"<title>{_e(name)}: {_e(_fmt(x))}, {_e(f'{y:.4g}')}</title></circle>"
                    for x, y in zip(px, py)
                ]
        return "".join(out)

    legend = [(n, COLORS[i % len(COLORS)]) for i, (n, _, _) in enumerate(series)] if len(series) > 1 else []
    return _frame(title, xlabel, ylabel, min(xs), max(xs), y0, y1, body, legend)


def stacked_bars(title: str, steps: list[float], layers: list[tuple[str, list[float]]], ylabel: str) -> str:
    """SVG stacked bars, one per log step (phases of the step time)."""
    if not steps:
        return f'<p class="empty">{_e(title)}: no data</p>'
    totals = [sum(vals[i] for _, vals in layers) for i in range(len(steps))]
    y1 = max(totals) * 1.05 or 1.0
    n = len(steps)

    def body(sx, sy):
        bw = max(sx(0.8) - sx(0), 1.0)
        out = []
        for i, step in enumerate(steps):
            x = sx(i + 0.1)
            base = 0.0
            for name, vals in layers:
                v = vals[i]
                if v > 0:
                    out.append(
                        f'<rect x="{x:.1f}" y="{sy(base + v):.1f}" width="{bw:.1f}" '
                        f'height="{sy(base) - sy(base + v):.1f}" fill="{PHASE_COLORS.get(name, "#999")}">'
                        f"<title>step {_e(_fmt(step))} {_e(name)}: {v:.2f} ms</title></rect>"
                    )
                base += v
        return "".join(out)

    legend = [(name, PHASE_COLORS.get(name, "#999")) for name, _ in layers]
    every = max(n // 8, 1)  # bars sit at their index; label about 8 of them with their step
    ticks = [(i + 0.5, _fmt(steps[i])) for i in range(0, n, every)]
    return _frame(title, "step", ylabel, 0, n, 0, y1, body, legend, ticks)


def _ok(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _col(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    got = [(r["step"], r[key]) for r in rows if _ok(r.get(key))]
    return [s for s, _ in got], [v for _, v in got]


def _load_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def build_report(run_dir: Path) -> str:
    """The report's HTML for a run folder written by `scaletrain train`."""
    run_dir = Path(run_dir)
    records = read_jsonl(run_dir / "metrics.jsonl")
    meta = _load_json(run_dir / "monitor" / "meta.json") or {}
    summary = _load_json(run_dir / "summary.json") or {}
    samples = read_samples(run_dir)
    top_ops = read_top_ops(run_dir)
    th = Thresholds(**{k: v for k, v in (meta.get("thresholds") or {}).items() if k in Thresholds.__dataclass_fields__})
    findings = diagnose(records, th, samples, top_ops, meta.get("pp_bubble_predicted"))
    train = [r for r in records if "loss" in r]
    timed = [r for r in train if "time_data_s" in r]

    charts = [
        line_chart(
            "Loss", [("train", *_col(train, "loss")), ("validation", *_col(records, "val_loss"))], "step", "loss"
        ),
        line_chart("Throughput", [("tokens/s", *_col(train, "tokens_per_s"))], "step", "tokens/s", zero=True),
    ]
    xs, mfu = _col(train, "mfu")
    charts.append(line_chart("MFU", [("MFU", xs, [v * 100 for v in mfu])], "step", "% of peak", zero=True))
    n_ranks = max((len(r.get("peak_mem_bytes_per_rank") or []) for r in timed), default=0)
    mem_label = "peak allocated, GB" if meta.get("device") == "cuda" else "peak RSS (CPU host), GB"
    charts.append(
        line_chart(
            "Peak memory per rank",
            [
                (f"rank {i}", [r["step"] for r in timed], [r["peak_mem_bytes_per_rank"][i] / 1e9 for r in timed])
                for i in range(n_ranks)
            ],
            "step",
            mem_label,
        )
    )
    phases = ("data", "forward", "backward", "comm", "optimizer", "other")
    charts.append(
        stacked_bars(
            "Step time breakdown (rank mean)",
            [r["step"] for r in timed],
            [(p, [r.get(f"time_{p}_s", 0.0) * 1e3 for r in timed]) for p in phases],
            "ms",
        )
    )
    charts.append(
        line_chart(
            "Busy time per rank (straggler check)",
            [
                (f"rank {i}", [r["step"] for r in timed], [r["busy_s_per_rank"][i] * 1e3 for r in timed])
                for i in range(n_ranks)
            ],
            "step",
            "ms per step",
        )
    )
    gpu = any(s.get("kind") == "gpu" for rs in samples.values() for s in rs)
    if gpu:
        charts.append(
            line_chart(
                "GPU power per rank",
                [
                    (f"rank {r}", [s["t"] for s in rs], [s.get("power_w") for s in rs])
                    for r, rs in sorted(samples.items())
                ],
                "seconds",
                "W",
            )
        )
        charts.append(
            line_chart(
                "GPU utilisation per rank",
                [
                    (f"rank {r}", [s["t"] for s in rs], [s.get("util_pct") for s in rs])
                    for r, rs in sorted(samples.items())
                ],
                "seconds",
                "%",
                zero=True,
            )
        )
    elif samples:
        charts.append(
            line_chart(
                "CPU host: process CPU per rank (no GPU)",
                [
                    (f"rank {r}", [s["t"] for s in rs], [s.get("process_cpu_pct") for s in rs])
                    for r, rs in sorted(samples.items())
                ],
                "seconds",
                "% of one core",
                zero=True,
            )
        )
        charts.append(
            line_chart(
                "CPU host: resident memory per rank (no GPU)",
                [
                    (f"rank {r}", [s["t"] for s in rs], [s.get("rss_bytes", 0) / 1e9 for s in rs])
                    for r, rs in sorted(samples.items())
                ],
                "seconds",
                "RSS, GB",
            )
        )

    sev = {"bottleneck": "bad", "warning": "warn", "info": "info"}
    diag = "".join(
        f'<div class="f {sev[f.severity]}"><b>{_e(f.severity.upper())}: {_e(f.title)}</b>'
        f"<p>Evidence: {_e(f.evidence)}</p><p>Suggestion: {_e(f.suggestion)}</p></div>"
        for f in findings
    )
    if not any(f.severity != "info" for f in findings):
        diag = (
            '<div class="f ok"><b>No bottleneck found</b><p>No rule fired over the measured breakdown.</p></div>' + diag
        )

    facts = {
        "run folder": run_dir.name,
        "device": meta.get("device_name"),
        "world size": meta.get("world_size"),
        "layout": meta.get("layout") or summary.get("layout"),
        "compute dtype": meta.get("dtype"),
        "steps": summary.get("steps"),
        "final loss": summary.get("final_loss"),
        "validation loss": summary.get("val_loss"),
        "tokens/s (whole run)": summary.get("tokens_per_s"),
        "peak FLOP/s used for MFU": meta.get("peak_source"),
        "MFU convention": meta.get("mfu_convention"),
        "exposed-communication measure": (timed[-1].get("comm_measure") if timed else None),
    }
    fact_rows = "".join(
        f"<tr><th>{_e(k)}</th><td>{_e(_fmt(v) if _ok(v) else v)}</td></tr>" for k, v in facts.items() if v is not None
    )
    ops = ""
    if top_ops and top_ops.get("ops"):
        ops = (
            "<h2>Top operators (profiler window, rank 0)</h2><table><tr><th>operator</th><th>self time, ms</th>"
            "<th>share</th><th>calls</th></tr>"
            + "".join(
                f"<tr><td>{_e(o['name'])}</td><td>{o['self_time_us'] / 1e3:.2f}</td><td>{o['share']:.1%}</td>"
                f"<td>{int(o['calls'])}</td></tr>"
                for o in top_ops["ops"][:10]
            )
            + "</table>"
        )
    config = (run_dir / "config.toml").read_text() if (run_dir / "config.toml").is_file() else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<link rel="icon" href="data:,">
<title>scaletrain report: {_e(run_dir.name)}</title>
<style>
body {{ font: 14px system-ui, sans-serif; margin: 24px; color: #222; }}
h1 {{ font-size: 22px; }} h2 {{ font-size: 17px; margin-top: 28px; }}
.charts {{ display: flex; flex-wrap: wrap; gap: 12px; }}
svg.chart {{ border: 1px solid #ddd; background: #fff; }}
svg text {{ font-size: 11px; fill: #333; }} svg text.t {{ font-size: 13px; font-weight: bold; }}
svg .g {{ stroke: #eee; }} svg .a {{ stroke: #888; }}
.f {{ border-left: 5px solid; padding: 6px 12px; margin: 8px 0; background: #fafafa; }}
.f p {{ margin: 4px 0; }} .bad {{ border-color: #d62728; }} .warn {{ border-color: #ff7f0e; }}
.info {{ border-color: #1f77b4; }} .ok {{ border-color: #2ca02c; }}
table {{ border-collapse: collapse; }} th, td {{ text-align: left; padding: 3px 10px; border-bottom: 1px solid #eee; }}
pre {{ background: #f6f6f6; padding: 10px; overflow-x: auto; }}
</style></head><body>
<h1>scaletrain report: {_e(run_dir.name)}</h1>
<h2>Diagnosis</h2>{diag}
<h2>Plots</h2><div class="charts">{"".join(charts)}</div>
<h2>Run</h2><table>{fact_rows}</table>
{ops}
<h2>Config</h2><pre>{_e(config)}</pre>
</body></html>
"""


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    out = Path(out) if out else Path(run_dir) / "report.html"
    out.write_text(build_report(Path(run_dir)), encoding="utf-8")
    return out
