"""`scaletrain report RUN_DIR`: one self-contained HTML file with the run's charts and the bottleneck diagnosis.

The charts are drawn by matplotlib and embedded as inline SVG (no script, nothing fetched at view time, prints as
vectors). The report reads one run: the folder's current run (monitor/run.json says when it started and how many
attempts it took); restarts and evaluations are marked on every chart's axis. Every string that comes from a
config, a log or a file name goes through html.escape (matplotlib escapes the text it writes into its SVG).
"""

from __future__ import annotations

import io
import json
import math
import time
from html import escape
from pathlib import Path

from scaletrain.monitor.diagnosis import Thresholds, diagnose, throughput_unit
from scaletrain.monitor.metrics import read_jsonl
from scaletrain.monitor.run_record import read_run_record
from scaletrain.monitor.session import read_samples, read_top_ops

PHASE_COLORS = {
    "data": "#d62728",
    "forward": "#1f77b4",
    "backward": "#2ca02c",
    "comm": "#ff7f0e",
    "optimizer": "#9467bd",
    "other": "#b0b0b0",
}
RESTART = {"color": "#d62728", "linestyle": "--", "linewidth": 1.2}
EVALUATION = {"color": "#7f7f7f", "linestyle": ":", "linewidth": 1.0}
NO_MFU_HINT = (
    "MFU needs a known peak: the GPU catalog's datasheet figure, or the matmul probe a run makes at start-up and "
    "caches per host"
)


def _e(value) -> str:
    return escape(str(value), quote=True)


def _ok(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _fmt(v) -> str:
    a = abs(v)
    if a >= 1e9:
        return f"{v / 1e9:.4g}G"
    if a >= 1e6:
        return f"{v / 1e6:.4g}M"
    if a >= 1e4:
        return f"{v / 1e3:.4g}k"
    return f"{v:.4g}"


class Marks:
    """Where the restarts and the evaluations fall on a step axis and on the time axis (seconds since run start)."""

    def __init__(self, records: list[dict], attempts: tuple[dict, ...]):
        self.restart_steps = [a.get("start_step", 0) for a in attempts[1:]]
        self.restart_times = [a.get("t_s", 0.0) for a in attempts[1:]]
        self.eval_steps = sorted({r["step"] for r in records if _ok(r.get("val_loss"))})
        timed = sorted((r["step"], r["t_s"]) for r in records if _ok(r.get("t_s")))
        # an evaluation runs right after its step's log record: it takes that record's time
        at = dict(timed)
        self.eval_times = [at[s] for s in self.eval_steps if s in at]

    def draw(self, ax, on_time: bool) -> None:
        for i, x in enumerate(self.restart_times if on_time else self.restart_steps):
            ax.axvline(x, **RESTART, label="restart" if i == 0 else None)
        for i, x in enumerate(self.eval_times if on_time else self.eval_steps):
            ax.axvline(x, **EVALUATION, label="evaluation" if i == 0 else None)


class Charts:
    """The report's charts, each an inline SVG drawn by matplotlib; series carry ids (`series-<chart>-<n>`)."""

    def __init__(self, marks: Marks):
        self.marks = marks
        self.html: list[str] = []

    def _axes(self, title: str, xlabel: str, ylabel: str):
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6.4, 3.2), layout="constrained")
        ax = fig.add_subplot()
        ax.set_title(title, fontsize=11, fontweight="bold")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, color="#e6e6e6", linewidth=0.8)
        ax.set_axisbelow(True)
        return fig, ax

    def _add(self, fig, ax, title: str, on_time: bool) -> None:
        import matplotlib

        self.marks.draw(ax, on_time)
        handles, labels = ax.get_legend_handles_labels()
        if len(labels) > 1 or self.marks.restart_steps or self.marks.eval_steps:
            # outside the axes, right of the data: a legend never hides a line
            fig.legend(handles, labels, loc="outside right upper", fontsize=8, frameon=False)
        out = io.StringIO()
        # svg.hashsalt: each chart's clip-path and marker ids differ from the others' in one HTML document
        with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": f"chart{len(self.html)}"}):
            fig.savefig(out, format="svg")
        svg = out.getvalue()
        self.html.append(f'<figure class="chart" aria-label="{_e(title)}">{svg[svg.index("<svg") :]}</figure>')

    def lines(
        self,
        title: str,
        series: list[tuple[str, list, list]],
        xlabel: str,
        ylabel: str,
        on_time: bool = False,
        zero: bool = False,
        points: bool = False,
    ) -> None:
        """A line per (name, xs, ys), drawn in the order given (not sorted: a series out of order shows as one);
        None and non-finite points are dropped."""
        kept = []
        for name, xs, ys in series:
            pts = [(x, y) for x, y in zip(xs, ys) if _ok(x) and _ok(y)]
            if on_time:  # no line across the time between two attempts: nothing was sampled then
                pts = _break_at(pts, self.marks.restart_times)
            if pts:
                kept.append((name, pts))
        if not kept:
            self.html.append(f'<p class="empty">{_e(title)}: no data</p>')
            return
        fig, ax = self._axes(title, xlabel, ylabel)
        n = len(self.html)
        for i, (name, pts) in enumerate(kept):
            style = {"marker": "o", "markersize": 4, "linestyle": "none"} if points else {"linewidth": 1.6}
            (line,) = ax.plot([x for x, _ in pts], [y for _, y in pts], label=name, **style)
            line.set_gid(f"series-{n}-{i}")
        if zero:
            ax.set_ylim(bottom=0)
        self._add(fig, ax, title, on_time)

    def loss(self, train: tuple[list, list], val: tuple[list, list]) -> None:
        fig, ax = self._axes("Loss", "step", "cross-entropy, nats/token")
        n = len(self.html)
        (line,) = ax.plot(*train, linewidth=1.6, label="train")
        line.set_gid(f"series-{n}-0")
        if val[0]:
            (dots,) = ax.plot(*val, marker="D", markersize=5, linestyle="none", color="#ff7f0e", label="validation")
            dots.set_gid(f"series-{n}-1")
        self._add(fig, ax, "Loss", on_time=False)

    def stacked(self, title: str, steps: list[int], layers: list[tuple[str, list[float]]], ylabel: str) -> None:
        """Stacked bars, one per log step (the phases of the step time)."""
        if not steps:
            self.html.append(f'<p class="empty">{_e(title)}: no data</p>')
            return
        fig, ax = self._axes(title, "step", ylabel)
        width = 0.8 * min((b - a for a, b in zip(steps, steps[1:])), default=1)
        base = [0.0] * len(steps)
        for name, vals in layers:
            ax.bar(steps, vals, width, bottom=base, color=PHASE_COLORS.get(name, "#999"), label=name)
            base = [b + v for b, v in zip(base, vals)]
        self._add(fig, ax, title, on_time=False)


def _break_at(pts: list[tuple[float, float]], xs: list[float]) -> list[tuple[float, float]]:
    """The points with a gap (a NaN, where matplotlib lifts the pen) wherever one of `xs` falls between two."""
    out = pts[:1]
    for a, b in zip(pts, pts[1:]):
        if any(a[0] < x <= b[0] for x in xs):
            out.append((b[0], math.nan))
        out.append(b)
    return out


def _col(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    got = [(r["step"], r[key]) for r in rows if _ok(r.get(key))]
    return [s for s, _ in got], [v for _, v in got]


def _per_rank(rows: list[dict], key: str, scale: float) -> list[tuple[str, list, list]]:
    """One series per rank from a per-rank list field (a resume on another world size changes its length)."""
    n = max((len(r.get(key) or []) for r in rows), default=0)
    return [
        (
            f"rank {i}",
            [r["step"] for r in rows if len(r.get(key) or []) > i],
            [r[key][i] * scale for r in rows if len(r.get(key) or []) > i],
        )
        for i in range(n)
    ]


def _load_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _run_facts(run_dir: Path) -> tuple[dict, tuple[dict, ...]]:
    run = read_run_record(run_dir)
    if run is None:
        return {"run started": "not recorded (folder written before monitor/run.json)"}, ()
    facts = {
        "run started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(run.started_at)),
        "attempts": len(run.attempts),
    }
    if run.resumed:
        facts["resumed"] = ", ".join(f"at step {a['start_step']} ({a['t_s']:.0f} s)" for a in run.attempts[1:])
    return facts, run.attempts


def _answers(records: list[dict]) -> str:
    """train.sample_prompts' answers at each evaluation: one row per prompt, one column per evaluated step."""
    evaluated = [r for r in records if isinstance(r.get("samples"), list)]
    if not evaluated:
        return ""
    prompts = list(dict.fromkeys(s.get("prompt", "") for r in evaluated for s in r["samples"]))
    head = "".join(f"<th>step {_e(r['step'])}</th>" for r in evaluated)
    rows = "".join(
        f'<tr><th><pre class="s">{_e(p)}</pre></th>'
        + "".join(
            f'<td><pre class="s">{_e(next((s.get("answer", "") for s in r["samples"] if s.get("prompt") == p), ""))}'
            f"</pre></td>"
            for r in evaluated
        )
        + "</tr>"
        for p in prompts
    )
    return f'<h2>Sample answers (train.sample_prompts, greedy)</h2><table class="samples"><tr><th>prompt</th>{head}</tr>{rows}</table>'


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
    run_facts, attempts = _run_facts(run_dir)

    charts = Charts(Marks(records, attempts))
    charts.loss(_col(train, "loss"), _col(records, "val_loss"))
    unit = throughput_unit(records)  # the task's: tokens for causal-lm, images for image tasks
    charts.lines("Throughput", [(f"{unit}/s", *_col(train, f"{unit}_per_s"))], "step", f"{unit}/s", zero=True)
    xs, mfu = _col(train, "mfu")
    if mfu:
        charts.lines("MFU", [("MFU", xs, [v * 100 for v in mfu])], "step", "MFU, % of peak FLOP/s", zero=True)
    mem_label = "peak allocated, GB" if meta.get("device") == "cuda" else "peak RSS (CPU host), GB"
    charts.lines("Peak memory per rank", _per_rank(timed, "peak_mem_bytes_per_rank", 1e-9), "step", mem_label)
    phases = ("data", "forward", "backward", "comm", "optimizer", "other")
    charts.stacked(
        "Step time breakdown (rank mean)",
        [r["step"] for r in timed],
        [(p, [r.get(f"time_{p}_s", 0.0) * 1e3 for r in timed]) for p in phases],
        "time per step, ms",
    )
    charts.lines(
        "Busy time per rank (straggler check)", _per_rank(timed, "busy_s_per_rank", 1e3), "step", "ms per step"
    )

    def sampled(key: str, scale: float = 1.0) -> list[tuple[str, list, list]]:
        return [
            (f"rank {r}", [s.get("t") for s in rs], [s[key] * scale if _ok(s.get(key)) else None for s in rs])
            for r, rs in sorted(samples.items())
        ]

    since = "time since run start, s"
    if any(s.get("kind") == "gpu" for rs in samples.values() for s in rs):
        charts.lines("GPU power per rank", sampled("power_w"), since, "power, W", on_time=True)
        charts.lines("GPU utilisation per rank", sampled("util_pct"), since, "utilisation, %", on_time=True, zero=True)
    elif samples:
        charts.lines(
            "CPU host: process CPU per rank (no GPU)",
            sampled("process_cpu_pct"),
            since,
            "CPU, % of one core",
            on_time=True,
            zero=True,
        )
        charts.lines(
            "CPU host: resident memory per rank (no GPU)",
            sampled("rss_bytes", 1e-9),
            since,
            "resident set, GB",
            on_time=True,
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

    final_mfu = mfu[-1] * 100 if mfu else None
    facts = {
        "run folder": run_dir.name,
        **run_facts,
        "device": meta.get("device_name"),
        "world size": meta.get("world_size"),
        "layout": meta.get("layout") or summary.get("layout"),
        "compute dtype": meta.get("dtype"),
        "steps": summary.get("steps"),
        "final loss": summary.get("final_loss"),
        "validation loss": summary.get("val_loss"),
        f"{unit}/s (whole run)": summary.get(f"{unit}_per_s"),
        "MFU (last log step)": f"{final_mfu:.2f}%" if final_mfu is not None else f"— ({NO_MFU_HINT})",
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
    no_mfu = "" if mfu else f'<p class="note">MFU —: {_e(meta.get("peak_source") or NO_MFU_HINT)}</p>'
    config = (run_dir / "config.toml").read_text() if (run_dir / "config.toml").is_file() else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<link rel="icon" href="data:,">
<title>scaletrain report: {_e(run_dir.name)}</title>
<style>
body {{ font: 14px system-ui, sans-serif; margin: 24px; color: #222; }}
h1 {{ font-size: 22px; }} h2 {{ font-size: 17px; margin-top: 28px; }}
.charts {{ display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 12px; }}
figure.chart {{ margin: 0; border: 1px solid #ddd; background: #fff; padding: 4px; }}
figure.chart svg {{ width: 100%; height: auto; display: block; }}
.f {{ border-left: 5px solid; padding: 6px 12px; margin: 8px 0; background: #fafafa; }}
.f p {{ margin: 4px 0; }} .bad {{ border-color: #d62728; }} .warn {{ border-color: #ff7f0e; }}
.info {{ border-color: #1f77b4; }} .ok {{ border-color: #2ca02c; }} .note {{ color: #555; }}
table {{ border-collapse: collapse; }} th, td {{ text-align: left; padding: 3px 10px; border-bottom: 1px solid #eee; }}
pre {{ background: #f6f6f6; padding: 10px; overflow-x: auto; white-space: pre-wrap; }}
pre.s {{ margin: 0; padding: 2px 4px; font: inherit; }}
@media print {{
  body {{ margin: 0; }} .charts {{ grid-template-columns: 1fr 1fr; }}
  figure.chart {{ break-inside: avoid; border: none; }}
}}
</style></head><body>
<h1>scaletrain report: {_e(run_dir.name)}</h1>
<h2>Diagnosis</h2>{diag}
<h2>Plots</h2>{no_mfu}<div class="charts">{"".join(charts.html)}</div>
<h2>Run</h2><table>{fact_rows}</table>
{_answers(records)}
{ops}
<h2>Config</h2><pre>{_e(config)}</pre>
</body></html>
"""


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    out = Path(out) if out else Path(run_dir) / "report.html"
    out.write_text(build_report(Path(run_dir)), encoding="utf-8")
    return out
