"""`scaletrain.setup()` on a user's own model and loop, as the documented examples run it under torchrun."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import run_cli_in_process, torchrun

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "custom_loop.py"


def _launch(script: Path, args, nproc, timeout=300):
    return torchrun(nproc, [str(script), *args], timeout=timeout)


def _run(args, nproc):
    proc = _launch(EXAMPLE, args, nproc)
    return [float(x) for x in re.findall(r"loss ([0-9.]+)", proc.stdout)]


# the 2-rank runs of the example are the full suite's; setup() on 2 ranks stays fast (test_fsdp_on_models_users_bring)
@pytest.mark.parametrize(
    "args, nproc",
    [
        ([], 1),
        pytest.param(["ddp"], 2, marks=pytest.mark.slow),
        pytest.param(["fsdp", "fp16"], 2, marks=pytest.mark.slow),
    ],
)
def test_custom_loop_trains(args, nproc):
    got = _run(args, nproc)
    assert len(got) == 4
    assert got[-1] < got[0] / 3


def _close(a, b, tol=1e-5):
    return all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b, strict=True))


def test_fsdp_on_models_users_bring(tmp_path):
    """One 2-rank launch (tests/setup_runner.py): FSDP through setup() on a HF causal LM (one unit per decoder
    layer), tied embeddings with the tied module named as a unit, a predicate, a tied model without a ModuleList,
    a ViT whose layers are bare ModuleLists and a BatchNorm CNN in bf16: every one trains, and (all but the
    BatchNorm one, whose statistics are per rank) loss for loss like the same model in one plain-torch process.
    scaletrain's own Llama with tp=2 takes its TP plan from its spec. Then a job.save() checkpoint of it goes through `ckpt ls` and `ckpt export` like the trainer's."""
    _launch(ROOT / "tests" / "setup_runner.py", [str(tmp_path)], 2, timeout=600)
    res = json.loads((tmp_path / "results.json").read_text())
    for name in ("hf_llama", "hf_llama_tied_named", "hf_llama_predicate", "tied_sequential", "vit", "builtin_llama_tp"):
        assert _close(res[name]["losses"], res[name]["ref"]), (name, res[name])
    assert res["hf_llama"]["units"] == 3 + 1  # each decoder layer, and the root
    assert res["hf_llama_predicate"]["units"] == 3 + 1  # each layer's mlp, and the root
    assert res["hf_llama_tied_named"]["units"] == 3 + 1  # the tied embedding stays with the root's lm_head
    assert res["tied_sequential"]["units"] == 1 + 1  # body; embed and head share a weight: the root
    assert res["vit"]["units"] == 2 * 3 + 1  # attention and feed-forward of a layer: one group per layer
    assert res["builtin_llama_tp"]["units"] == 0 and res["builtin_llama_tp"]["dtensors"] > 0  # TP only (dp=1)
    cnn = res["cnn_bf16"]
    assert all(torch.isfinite(torch.tensor(cnn["losses"]))) and cnn["losses"][-1] < cnn["losses"][0]
    assert _close(cnn["losses"], cnn["ref"], tol=2e-2)  # bf16 compute, per-rank BatchNorm statistics

    ckpt = Path((tmp_path / "saved_at.txt").read_text())
    assert ckpt.name == "step_00000003"
    listed = run_cli_in_process(["ckpt", "ls", str(ckpt.parent)], tmp_path).stdout
    assert "step_00000003" in listed and "fsdp (dp_shard=2)" in listed and "BAD" not in listed
    run_cli_in_process(["ckpt", "export", str(ckpt.parent), "--out", str(tmp_path / "st")], tmp_path)
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "st" / "model.safetensors"))
    gathered = torch.load(tmp_path / "hf_state.pt", weights_only=True)
    assert exported.keys() == gathered.keys()
    assert all(torch.equal(exported[k], gathered[k]) for k in gathered)
    # a transformers model's checkpoint records its config: the hf export is the same weights under transformers
    run_cli_in_process(["ckpt", "export", str(ckpt), "--format", "hf", "--out", str(tmp_path / "hf")], tmp_path)
    as_hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert as_hf.keys() <= gathered.keys() and all(torch.equal(v, gathered[k]) for k, v in as_hf.items())
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama"
    # a model with no spec recorded (any other nn.Module) has no known HF layout: refused in one line
    bare = tmp_path / "bare" / ckpt.name
    shutil.copytree(ckpt, bare)
    manifest = json.loads((bare / "manifest.json").read_text())
    manifest.pop("model_spec")
    (bare / "manifest.json").write_text(json.dumps(manifest))
    refused = run_cli_in_process(
        ["ckpt", "export", str(bare), "--format", "hf", "--out", str(tmp_path / "no")], tmp_path, check=False
    )
    assert refused.returncode == 2 and "--format safetensors or torch" in refused.stderr
    assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1


def test_hsdp_without_a_shard_group_is_refused():
    from scaletrain.api import _layout
    from scaletrain.config.layout import DataParallelMode

    with pytest.raises(ValueError, match=r"^dp_replicate: HSDP needs .* shard groups of >= 2 ranks \(got 2\)"):
        _layout("hsdp", 2, 2)
    with pytest.raises(ValueError, match="^tp: 3 does not divide the 4 ranks"):
        _layout("fsdp", 4, None, tp=3)
    layout = _layout("hsdp", 4, 2)
    assert (layout.dp_replicate, layout.dp_shard, layout.mode) == (2, 2, DataParallelMode.HSDP)
    layout = _layout("fsdp", 4, None, tp=2)
    assert (layout.dp_replicate, layout.dp_shard, layout.tp, layout.mode) == (1, 2, 2, DataParallelMode.FSDP)


def test_tp_plan_errors_are_one_line():
    from scaletrain.api import _tp_styles

    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="^tp_plan: give a non-empty"):
        _tp_styles(model, 2, lambda m: [], None)
    assert _tp_styles(model, 1, {"x": None}, None) is None  # nothing to split at tp=1
    with pytest.raises(ValueError, match="^tp: Sequential is not a transformers model .* pass tp_plan="):
        _tp_styles(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), 2, None, None)


def test_tp_on_a_transformers_model_follows_its_own_plan_or_is_refused_in_one_line():
    """setup(tp=2) without a plan on a transformers model: its base_model_tp_plan as model.hf trains it (GPT-2: its
    Conv1D layers split by structure); what cannot be split is refused in one line naming the fix."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from transformers import AutoConfig, AutoModelForCausalLM

    from scaletrain.api import _tp_styles

    def tiny(model_type: str, **fields):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, vocab_size=64, **fields))

    decoder = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    plan = _tp_styles(tiny("llama", **decoder, num_key_value_heads=2), 2, None, None)
    assert type(plan["model.layers.1.self_attn.k_proj"]) is ColwiseParallel  # 'colwise' in the model's plan
    assert type(plan["model.layers.1.mlp.down_proj"]) is RowwiseParallel
    assert "model.layers.1.input_layernorm" in plan and "model.norm" in plan  # every parameter a DTensor
    gpt2 = _tp_styles(tiny("gpt2", n_embd=64, n_layer=2, n_head=4), 2, None, None)
    assert type(gpt2["transformer.h.0.attn.c_attn"]).__name__ == "FusedQKVConv1D"

    def refusal(model) -> str:
        with pytest.raises(ValueError) as e:
            _tp_styles(model, 2, None, None)
        assert "\n" not in str(e.value) and str(e.value).startswith("tp: ") and "parallel." not in str(e.value)
        return str(e.value)

    moe = tiny("qwen3_moe", **decoder, head_dim=16, num_experts=4, moe_intermediate_size=32)
    assert "use tp=1 and shard them with FSDP instead" in refusal(moe)
    assert "does not divide LlamaForCausalLM.config.num_key_value_heads=1" in refusal(
        tiny("llama", **decoder, num_key_value_heads=1)
    )
    assert "no tensor-parallel plan" in refusal(tiny("bloom", hidden_size=64, n_layer=2, n_head=4))


def test_shard_rule_errors_are_one_line():
    from scaletrain.parallel.blocks import fsdp_units

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"^shard: no module of the Sequential matches .*leave shard=None"):
        fsdp_units(model, shard=nn.Conv2d)
    with pytest.raises(ValueError, match="^shard: give module classes"):
        fsdp_units(model, shard=["Linear"])  # type: ignore[list-item]
    assert fsdp_units(model, shard=lambda name, m: name == "1") == [model[1]]


def test_loader_position_means_the_same_under_any_world_size():
    """The samples of every step are the same whether 1, 2 or 4 ranks share them, and a loader resumed from a
    position saved under 2 ranks continues under 4 with exactly the samples not yet seen (across an epoch end)."""
    from scaletrain.data.map_style import ResumableLoader

    data = list(range(10))

    def steps(world, n, state=None):
        per_rank = []
        for rank in range(world):
            loader = ResumableLoader(data, 4, rank, world, seed=3)
            if state:
                loader.load_state_dict(state)
            it = iter(loader)
            per_rank.append([next(it).tolist() for _ in range(n)])
            last = loader.state_dict()
        return [sum((r[s] for r in per_rank), []) for s in range(n)], last

    whole, _ = steps(1, 6)
    assert steps(2, 6)[0] == whole == steps(4, 6)[0]
    assert sorted(whole[0] + whole[1] + whole[2][:2]) == data  # one epoch: every sample once
    first, state = steps(2, 2)
    assert state["consumed_samples"] == 8
    rest, _ = steps(4, 4, state)
    assert first + rest == whole
    with pytest.raises(ValueError, match="^global_batch_size: 6 is not a positive multiple of the 4"):
        ResumableLoader(data, 6, 0, 4)


def _steps(stdout: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"^step (\d+) loss ([0-9.]+)", stdout, re.M)}


@pytest.mark.slow  # 2- then 4-rank launches; setup() training is test_custom_loop_trains and test_fsdp_on_models_users_bring
def test_hf_example_tp_saves_and_resumes_on_another_rank_count(tmp_path):
    """examples/hf_causal_lm.py: a HF Llama on 2 ranks (tp=2, no plan given: the model's own base_model_tp_plan)
    saves at step 5 and stops; the run resumed on 4 ranks (FSDP 2 x TP 2, the user's TP plan this time) continues
    loss for loss like one uninterrupted plain-python process."""
    script = ROOT / "examples" / "hf_causal_lm.py"
    whole = _steps(_launch(script, [], 1).stdout)
    assert sorted(whole) == list(range(1, 11)) and whole[10] < whole[1]
    ckpt = str(tmp_path / "ckpt")
    first = _launch(script, ["--tp", "2", "--ckpt", ckpt, "--stop-at", "5"], 2)
    assert "layout tp=2" in first.stdout
    second = _launch(script, ["--tp", "2", "--tp-plan", "mine", "--ckpt", ckpt], 4, timeout=600)
    assert "layout fsdp (dp_shard=2 x tp=2)" in second.stdout and "resumed at step 5 on 4 ranks" in second.stdout
    got = {**_steps(first.stdout), **_steps(second.stdout)}
    assert sorted(got) == list(range(1, 11))
    assert _close([got[s] for s in range(1, 11)], [whole[s] for s in range(1, 11)]), (got, whole)
    # the checkpoint setup() wrote records the transformers model, so it exports as a folder from_pretrained loads
    step = Path(ckpt) / "step_00000005"
    run_cli_in_process(["ckpt", "export", str(step), "--format", "hf", "--out", str(tmp_path / "hf")], tmp_path)
    run_cli_in_process(
        ["ckpt", "export", str(step), "--format", "safetensors", "--out", str(tmp_path / "st")], tmp_path
    )
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    saved = load_file(str(tmp_path / "st" / "model.safetensors"))
    assert saved.keys() == model.state_dict().keys()
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())


@pytest.mark.slow  # a launch of another example; setup() with FSDP is test_fsdp_on_models_users_bring
def test_vision_example_fsdp_bf16_with_batchnorm():
    proc = _launch(ROOT / "examples" / "vision_bf16.py", [], 2)
    assert "layout fsdp (dp_shard=2)" in proc.stdout
    got = [float(x) for x in re.findall(r"loss ([0-9.]+)", proc.stdout)]
    assert len(got) == 4 and got[-1] < got[0] / 2
