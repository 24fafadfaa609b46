"""`scaletrain train --plan auto`: the planner's fastest runnable layout for the local ranks, applied as overrides
(the user's own win), announced in one line; a bad mode is one line and exit 2."""

from __future__ import annotations

import tomllib

import pytest

from click.testing import CliRunner

from scaletrain.cli.main import main
from scaletrain.config import validate_config
from scaletrain.resolve import resolve_job

from conftest import losses, run_cli


def printed(args):
    r = CliRunner().invoke(main, ["train", "--plan", "auto", "--print-config", *args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return validate_config(tomllib.loads(r.stdout)), r.stderr


def test_plan_auto_prints_a_runnable_layout_for_the_world():
    cfg, said = printed(["--nproc-per-node", "4", "run.device=cpu", "train.global_batch_size=16"])
    p = cfg.parallel
    assert p.dp_replicate * max(p.dp_shard, 1) * p.tp * p.pp == 4
    resolve_job(cfg, 4)  # a valid job for 4 ranks
    assert said.count("\n") == 1 and "plan auto:" in said and "predicted" in said and "ms/step" in said
    # the CPU model (no comm/compute overlap under gloo) picks plain DDP, as benchmarks/layouts.py measured
    assert (p.dp_replicate, p.dp_shard, p.tp, p.pp) == (4, 1, 1, 1)


def test_user_settings_win_over_the_plan():
    cfg, _ = printed(["--nproc-per-node", "4", "run.device=cpu", "precision.dtype=bf16", "parallel.pp=2"])
    assert cfg.precision.dtype == "bf16" and cfg.parallel.pp == 2
    resolve_job(cfg, 4)


def test_bad_plan_mode_is_one_line_exit_2():
    r = CliRunner().invoke(main, ["train", "--plan", "fastest", "--print-config"])
    assert r.exit_code == 2
    assert r.stderr.strip().count("\n") == 0 and "--plan" in r.stderr and "auto" in r.stderr
    assert "--plan" in CliRunner().invoke(main, ["train", "--help"]).output


@pytest.mark.slow  # a launch; the plan applied to the typed config stays fast (test_the_chosen_layout_is_applied_...)
def test_plan_auto_trains(workdir):
    proc = run_cli(
        [
            "train",
            "--plan",
            "auto",
            "train.steps=3",
            "data.seq_len=64",
            "data.max_bytes=300000",
            "train.eval_batches=1",
            "monitor.progress=false",
            "monitor.log_interval=1",
            "--nproc-per-node",
            "2",
            "run.device=cpu",
        ],
        cwd=workdir,
    )
    assert "plan auto:" in proc.stderr
    assert len(losses(workdir / "runs" / "default")) == 3


def test_the_chosen_layout_is_applied_to_the_typed_config_not_reparsed(monkeypatch):
    from scaletrain.config import load_config
    from scaletrain.plan import Layout, auto

    user = ["run.device=cpu", "train.global_batch_size=16", "precision.dtype=bf16", "parallel.pp=2"]
    loads = []
    monkeypatch.setattr(auto, "load_config", lambda *a: loads.append(a) or load_config(*a))

    def no_strings(self):
        raise AssertionError("as_overrides is for people to read; --plan auto applies the Layout itself")

    with monkeypatch.context() as m:
        m.setattr(Layout, "as_overrides", no_strings)
        chosen = auto.auto_plan(None, user, 4, 1, "cpu")
    assert len(loads) == 1  # the user's config, read once; no candidate goes back through key=value strings
    lay = chosen.row.layout
    assert isinstance(lay, Layout) and (lay.pp, lay.precision) == (2, "bf16")
    assert chosen.config == lay.apply(load_config(None, user))
    # the same job as the plan's printed overrides followed by the user's, which win
    assert chosen.config == load_config(None, [*lay.as_overrides().split(), *user])
