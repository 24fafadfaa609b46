"""Diagnosis rules and the HTML report over hand-made run records (no processes started)."""

import json

from scaletrain.monitor.diagnosis import Thresholds, diagnose, flagged
from scaletrain.monitor.report import build_report


def _rec(step, data=0.001, fwd=0.03, bwd=0.05, comm=(0.002, 0.002), opt=0.01, busy=(0.09, 0.09), **extra):
    st = data + fwd + bwd + sum(comm) / len(comm) + opt + 0.002
    return {
        "step": step,
        "loss": 5.0 - step * 0.1,
        "step_time_s": st,
        "tokens_per_s": 1000 / st,
        "mfu": 0.01,
        "time_data_s": data,
        "time_forward_s": fwd,
        "time_backward_s": bwd,
        "time_comm_s": sum(comm) / len(comm),
        "time_optimizer_s": opt,
        "time_other_s": 0.002,
        "busy_s_per_rank": list(busy),
        "comm_s_per_rank": list(comm),
        "peak_mem_bytes_per_rank": [4e8, 4e8],
        "comm_measure": "grad-ready hooks",
        **extra,
    }


def test_rules_name_each_bottleneck_and_spare_a_healthy_run():
    assert flagged(diagnose([_rec(s) for s in range(1, 8)])) == []
    data = diagnose([_rec(s, data=0.05) for s in range(1, 8)])
    assert [f.rule for f in flagged(data)] == ["data_loader_bound"]
    slow = flagged(diagnose([_rec(s, busy=(0.09, 0.15), comm=(0.06, 0.002)) for s in range(1, 8)]))
    assert [f.rule for f in slow] == ["straggler"] and slow[0].ranks == [1] and "rank 1" in slow[0].title
    comm = flagged(diagnose([_rec(s, comm=(0.08, 0.08)) for s in range(1, 8)]))
    assert [f.rule for f in comm] == ["communication_bound"]
    pp = flagged(diagnose([_rec(s, pp_bubble_measured=0.5) for s in range(1, 8)], pp_bubble_predicted=0.2))
    assert [f.rule for f in pp] == ["pipeline_bubble"]
    mem = flagged(diagnose([_rec(s, mem_capacity_bytes=80e9) for s in range(1, 8)]))
    assert [f.rule for f in mem] == ["memory_headroom"] and "bigger" in mem[0].suggestion
    idle = flagged(diagnose([_rec(1)], samples={0: [{"kind": "gpu", "util_pct": 5.0}] * 4}))
    assert [f.rule for f in idle] == ["idle_rank"]
    # thresholds are the user's: a 5 % data wait is only flagged when asked for
    assert flagged(diagnose([_rec(s, data=0.006) for s in range(1, 8)], Thresholds(data_wait_pct=20))) == []
    assert flagged(diagnose([_rec(s, data=0.006) for s in range(1, 8)], Thresholds(data_wait_pct=3)))


def test_report_escapes_every_string_from_configs_and_logs(tmp_path):
    evil = "<script>alert('x')</script>"
    (tmp_path / "config.toml").write_text(f'[data]\npath = "{evil}"\n')
    rows = [_rec(s, comm_measure=f"<img src=x onerror=alert(1)>{s}") for s in range(1, 5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "monitor").mkdir()
    (tmp_path / "monitor" / "meta.json").write_text(
        json.dumps({"device": "cpu", "layout": evil, "peak_source": "<b>bold</b>"})
    )
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "top_ops_rank0.json").write_text(
        json.dumps(
            {
                "rank": 0,
                "time": "cpu",
                "ops": [{"name": "<svg onload=alert(2)>", "self_time_us": 5.0, "calls": 1, "share": 1.0}],
            }
        )
    )
    html = build_report(tmp_path)
    for raw in (evil, "<img src=x", "<b>bold</b>", "<svg onload"):
        assert raw not in html
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in html and "&lt;svg onload=alert(2)&gt;" in html
    assert "<script" not in html  # the report runs no script at all
    assert html.count("<svg") >= 5  # loss, throughput, MFU, memory, breakdown, busy per rank


def test_run_resumed_on_another_world_size_is_judged_on_its_last_layout():
    from scaletrain.monitor.diagnosis import diagnose

    def rec(step, ranks):
        return {
            "step": step,
            "step_time_s": 0.1,
            "time_data_s": 0.0,
            "time_comm_s": 0.0,
            "busy_s_per_rank": [0.08] * ranks,
            "comm_s_per_rank": [0.01] * ranks,
        }

    records = [rec(s, 4) for s in range(1, 6)] + [rec(s, 2) for s in range(6, 11)]
    assert [f.rule for f in diagnose(records)] == []
