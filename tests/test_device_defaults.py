"""What the job does by default on the device it runs on: precision.dtype=auto (bf16 on a GPU with bf16, fp32 on a
CPU), parallel.compile=auto (off on a CPU; on with fp8 on a GPU, where eager fp8 is refused; otherwise decided by
timing the first steps), and the launcher on torches whose agent lacks newer fields. The GPU is mocked here
(no GPU in CI); benchmarks/gpu_check.sh runs the real path on one."""

import pytest
import torch

from conftest import FAST, run_cli_in_process
from scaletrain.config import load_config
from scaletrain.parallel.compile import COMPILE_SECONDS, COMPILE_SPEEDUP, CompileProbe
from scaletrain.resolve import settle_device_defaults


def _gpu(monkeypatch, bf16: bool = True) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)


def settled(overrides: list[str], device: str):
    return settle_device_defaults(load_config(None, overrides), device)


def test_dtype_auto_is_bf16_on_a_gpu_with_bf16_and_fp32_elsewhere(monkeypatch):
    assert settled([], "cpu").precision.dtype == "fp32"
    assert settled(["precision.fp8=tensorwise"], "cpu").precision.dtype == "bf16"  # fp8 runs on top of bf16
    _gpu(monkeypatch, bf16=False)  # e.g. a V100 (compute capability 7.0)
    assert settled([], "cuda").precision.dtype == "fp32"
    _gpu(monkeypatch, bf16=True)
    assert settled([], "cuda").precision.dtype == "bf16"
    assert settled(["precision.dtype=fp32"], "cuda").precision.dtype == "fp32"  # what the user set stays


def test_compile_auto_off_on_cpu_on_with_fp8_on_a_gpu_else_left_to_the_probe(monkeypatch):
    assert settled([], "cpu").parallel.compile is False
    assert settled(["parallel.compile=true"], "cpu").parallel.compile is True  # asked for: compiled on a CPU too
    _gpu(monkeypatch)
    assert settled([], "cuda").parallel.compile == "auto"  # the loop's probe decides
    assert settled(["precision.fp8=tensorwise"], "cuda").parallel.compile is True
    zero_bubble = ["parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble"]
    assert settled(zero_bubble, "cuda").parallel.compile is False  # torch.compile cannot split backward


def test_eager_fp8_on_a_gpu_is_refused_in_one_line_naming_compile(monkeypatch):
    _gpu(monkeypatch)
    with pytest.raises(ValueError) as err:
        settled(["precision.fp8=rowwise", "parallel.compile=false"], "cuda")
    message = str(err.value)
    assert message.startswith("precision.fp8: rowwise without compile") and "parallel.compile=true" in message
    assert "\n" not in message
    assert settled(["precision.fp8=rowwise", "parallel.compile=false"], "cpu").parallel.compile is False  # emulated
    zero_bubble = ["parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble", "precision.fp8=tensorwise"]
    with pytest.raises(ValueError, match=r"^precision.fp8: tensorwise needs compiled blocks on a GPU, which ZBV"):
        settled(zero_bubble, "cuda")


def test_the_planner_prices_fp8_on_a_gpu_compiled_and_never_with_a_schedule_compile_cannot_run(tmp_path):
    """`scaletrain plan --fp8` prices what the trainer runs on a GPU: compiled blocks (no split-backward pipeline
    schedule, which compile cannot run): the same layouts as with --compile."""
    from conftest import run_cli_in_process

    base = ["plan", "--model", "llama-8b", "--gpus", "16", "--gpu", "h100-sxm", "--top", "400", "--json"]
    fp8 = run_cli_in_process([*base, "--fp8", "tensorwise"], tmp_path).stdout
    assert "ZeroBubble" not in fp8 and "DualPipeV" not in fp8
    eager = run_cli_in_process(base, tmp_path).stdout
    assert "ZeroBubble" in eager or "DualPipeV" in eager  # eager bf16 does consider them


def test_the_probe_compiles_when_the_steps_left_repay_the_compilation():
    # the H200 default job: 300 steps of ~25 ms (7.6 s in all) never repay ~20 s of compilation
    probe = CompileProbe(steps=300, start_step=0)
    assert [probe.timing(s) for s in (1, 2, 3, 4)] == [True, False, True, False]
    assert probe.observe(1, 10.0) is None
    eager = probe.observe(3, 10.05)
    assert eager == pytest.approx(0.025)
    stay = probe.decide(eager)
    assert not stay.compile and stay.steps_left == 297 and "staying eager" in stay.describe()
    # llama-1b at 225 ms per step for 1,000 steps: ~53 s saved against ~20 s
    go = CompileProbe(steps=1000, start_step=0).decide(0.225)
    assert go.compile and go.saves_s == pytest.approx(997 * 0.225 * (1 - 1 / COMPILE_SPEEDUP))
    assert go.saves_s > COMPILE_SECONDS and "compiling the blocks" in go.describe()
    # a resumed run probes the steps after the one it resumed from
    resumed = CompileProbe(steps=1000, start_step=990)
    assert resumed.decide_at == 993 and not resumed.decide(0.225).compile


def test_launcher_on_an_agent_without_shutdown_timeout(monkeypatch, tmp_path):
    """torch 2.11/2.12's LaunchConfig has no shutdown_timeout (the GPU image's torch crashed on it): the agent
    config leaves it out, and a grace other than torch's fixed 30 s is refused in one line before launch."""
    from torch.distributed.launcher import api

    from scaletrain.launch import local

    made: dict = {}
    monkeypatch.setattr(api, "LaunchConfig", lambda **kw: made.update(kw) or kw)
    monkeypatch.setattr(local, "_agent_fields", lambda: frozenset({"min_nodes", "shutdown_timeout"}))
    local.agent_config(45, min_nodes=1)
    assert made == {"min_nodes": 1, "shutdown_timeout": 45}  # torch 2.13: passed on
    made.clear()
    monkeypatch.setattr(local, "_agent_fields", lambda: frozenset({"min_nodes"}))
    local.agent_config(45, min_nodes=1)
    assert made == {"min_nodes": 1}
    local.check_agent_supports(load_config(None, []).launch)  # the default, 30 s: what the old agent does anyway
    proc = run_cli_in_process(["train", *FAST, "launch.shutdown_timeout_s=45"], tmp_path, check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("scaletrain: error: launch.shutdown_timeout_s: torch ")
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "runs").exists()


def test_the_rendezvous_names_its_events_as_torch_does_without_inspect_stack():
    """speed_up_rendezvous_events swaps torch's inspect.stack()-based event naming for a frame walk that returns the
    same name (the function two frames up)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from scaletrain.launch.local import speed_up_rendezvous_events

    def _record():
        return dynamic_rendezvous.get_method_name()

    def next_rendezvous():
        return _record()

    want = next_rendezvous()
    speed_up_rendezvous_events()
    assert want == next_rendezvous() == "next_rendezvous"
    assert dynamic_rendezvous.get_method_name(10_000) == "no_method_name"
