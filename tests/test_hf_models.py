"""Hugging Face models through the normal trainer (`model.hf=FOLDER`): for each family, built from a tiny random
config here and saved with save_pretrained (nothing downloaded), DDP 2 / FSDP 2 / TP 2 (+SP) / PP 2 give the per-step
losses of one process over 5 steps; the first loss equals transformers' own forward on the saved weights; an
exported checkpoint (in several safetensors shards) loads with from_pretrained and gives the same logits; bad folders and layouts are one line
before launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import FAST, losses, run_cli, run_cli_in_process
from test_parallel_layouts import launch_runner, runner_losses

TOL = 1e-5
SMALL = dict(vocab_size=256, max_position_embeddings=128)
DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
FAMILIES: dict[str, dict] = {
    "llama": dict(model_type="llama", **DECODER, tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", **DECODER, head_dim=16, tie_word_embeddings=True),  # q/k norms, tied
    "mistral": dict(model_type="mistral", **DECODER, sliding_window=16, tie_word_embeddings=False),  # < seq_len
    # soft-capped attention and logits, sliding window, 1-centred norms, scaled embedding, tied
    "gemma2": dict(model_type="gemma2", **DECODER, head_dim=16, sliding_window=16, tie_word_embeddings=True),
    "phi3": dict(model_type="phi3", **DECODER, pad_token_id=None, tie_word_embeddings=False),  # fused qkv_proj
    # Conv1D layout, fused c_attn, biases, learned positions, tied; dropout off so layouts can be compared
    "gpt2": dict(
        model_type="gpt2",
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=128,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        **DECODER,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        tie_word_embeddings=False,
    ),
}
# experts transposed, interleaved, with biases: not split by expert parallelism (models/hf/experts.py splittable)
GPT_OSS = dict(model_type="gpt_oss", **DECODER, head_dim=16, num_local_experts=4, num_experts_per_tok=2)
# TP with dp_shard 1 refused in one line (test_bad_input_is_one_line_before_launch): FSDP sums its experts' gradients
# over the TP ranks, each routing a piece of the tokens (its TP layouts run in tests/test_moe.py)
NO_TP = ("qwen3_moe",)
STEPS = ["train.steps=5", "data.seq_len=32", "train.global_batch_size=8"]
LAYOUTS = {
    "ddp2": ["parallel.dp_replicate=2", "parallel.dp_shard=1"],
    "fsdp2": [],
    "tp2": ["parallel.tp=2", "parallel.dp_shard=1"],
    "tp2sp": ["parallel.tp=2", "parallel.dp_shard=1", "parallel.sequence_parallel=true"],
    "pp2": ["parallel.pp=2", "parallel.dp_shard=1"],
}


def save_hf_folder(out: Path, fields: dict, seed: int = 0, weights: bool = True) -> Path:
    """A random model of that config, saved as transformers saves it (config.json + model.safetensors), or only
    its config.json."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(fields)
    cfg = AutoConfig.for_model(fields.pop("model_type"), **{**SMALL, **fields})
    torch.manual_seed(seed)
    if weights:
        AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    else:
        cfg.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {name: save_hf_folder(root / name, f) for name, f in FAMILIES.items()}


@pytest.fixture(scope="module")
def runs(folders, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf_runs")
    # a V schedule puts the first and the last stage on one rank: a tied embedding's two copies meet there
    deep = save_hf_folder(out / "qwen3_deep", {**FAMILIES["qwen3"], "num_hidden_layers": 4})
    v_shape = ["parallel.pp=2", "parallel.dp_shard=1", "parallel.pp_schedule=ZBVZeroBubble"]
    single = {f"{n}_single": [*STEPS, f"model.hf={p}", "parallel.dp_shard=1"] for n, p in folders.items()}
    # the same launch trains each family with the trainer's own loop and a final checkpoint (the export test's
    # input; `scaletrain train model.hf=...` itself runs in test_train_through_the_cli_writes_the_same_run)
    fits = {f"{n}_fit": [*STEPS, f"model.hf={p}", *_fit_run(out, n)] for n, p in folders.items()}
    single |= {"qwen3_deep_single": [*STEPS, f"model.hf={deep}", "parallel.dp_shard=1"], **fits}
    launch_runner(1, single, out, fit=frozenset(fits))
    jobs = {
        f"{n}_{layout}": [*STEPS, f"model.hf={p}", *extra]
        for n, p in folders.items()
        for layout, extra in LAYOUTS.items()
        if not _skipped(n, layout)
    }
    launch_runner(2, {**jobs, "qwen3_deep_pp2v": [*STEPS, f"model.hf={deep}", *v_shape]}, out)
    return out


def _fit_run(out: Path, family: str) -> list[str]:
    return [f"run.output_dir={out / 'fit'}", f"run.name={family}", "checkpoint.save_final=true"]


def _skipped(family: str, layout: str) -> bool:
    return family in NO_TP and layout.startswith("tp")


def _cases() -> list[tuple[str, str]]:
    return [(n, lay) for n in FAMILIES for lay in LAYOUTS if not _skipped(n, lay)]


@pytest.mark.slow  # the 1- and 2-rank launches of every family; layout parity is test_parity.py's, HF config errors stay fast here
@pytest.mark.parametrize(("family", "layout"), _cases())
def test_every_layout_trains_a_hf_family_with_the_losses_of_one_process(runs, family, layout):
    ref, got = runner_losses(runs / f"{family}_single"), runner_losses(runs / f"{family}_{layout}")
    assert len(ref) == len(got) == 5 and ref[-1] < ref[0]  # it learns
    for step, (a, b) in enumerate(zip(ref, got), 1):
        assert abs(a - b) <= TOL, f"{family} {layout} step {step}: {b} vs single-process {a}"


@pytest.mark.slow  # shares the HF launches
def test_a_tied_embedding_whose_copies_share_a_pipeline_rank_trains_as_one_process(runs):
    ref, got = runner_losses(runs / "qwen3_deep_single"), runner_losses(runs / "qwen3_deep_pp2v")
    assert len(ref) == len(got) == 5 and ref[-1] < ref[0]
    for step, (a, b) in enumerate(zip(ref, got), 1):
        assert abs(a - b) <= TOL, f"qwen3 ZBVZeroBubble step {step}: {b} vs single-process {a}"


@pytest.mark.slow  # shares the HF launches
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_first_loss_from_saved_weights_is_transformers_own(runs, folders, family):
    """Step 1's loss is computed before any update: transformers' from_pretrained model on the same batch."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from scaletrain.config import load_config
    from scaletrain.resolve import resolve_job
    from scaletrain.train.trainer import build_loaders

    cfg = load_config(None, [*FAST, *STEPS, f"model.hf={folders[family]}", "parallel.dp_shard=1"])
    loader, _ = build_loaders(cfg, resolve_job(cfg, 1), 0, 1)
    batch = loader.next_step()
    inputs, targets = torch.cat([b.inputs for b in batch]), torch.cat([b.targets for b in batch])
    model = AutoModelForCausalLM.from_pretrained(folders[family], dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    theirs = F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    ours = runner_losses(runs / f"{family}_single")[0]
    assert abs(ours - theirs) <= TOL, f"{family}: first loss {ours}, transformers' forward {theirs}"


@pytest.mark.slow  # shares the HF launches; HF export is test_checkpoint.py's export test
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_checkpoint_exports_to_a_folder_from_pretrained_loads_with_the_same_logits(runs, folders, tmp_path, family):
    from transformers import AutoModelForCausalLM

    from scaletrain.checkpoint.export import export_checkpoint, load_full_model_state

    ckpt = runs / "fit" / family / "checkpoints/step_00000005"  # trained 5 steps by the trainer's loop (runs)
    # shards of at most 100 KB (these models are 0.4-1 MB): several files and their index, written one at a time;
    # in this process (`ckpt export` is this function; its CLI runs in tests/test_checkpoint.py)
    export_checkpoint(ckpt, tmp_path / "out", "hf", "100KB")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted((tmp_path / "out").glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == {f.name for f in shards}
    header = [int.from_bytes(f.read_bytes()[:8], "little") + 8 for f in shards]  # safetensors' JSON header
    assert all(f.stat().st_size - h <= 100_000 or len(_file_keys_of(f)) == 1 for f, h in zip(shards, header))
    state, spec = load_full_model_state(ckpt)
    ours = spec.build("cpu")
    ours.load_state_dict(state)
    spec.tie(ours)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    start = AutoModelForCausalLM.from_pretrained(folders[family], dtype=torch.float32)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    ours.eval(), theirs.eval(), start.eval()
    with torch.no_grad():
        a, b, before = ours(x), theirs(input_ids=x).logits, start(input_ids=x).logits
    assert (a - b).abs().max().item() <= TOL
    assert (a - before).abs().max().item() > 1e-3  # the export holds the trained weights, not the starting ones
    # laid out as transformers saves the model (tied output once, mixture-of-experts weights expert by expert)
    assert _file_keys(tmp_path / "out") == _file_keys(folders[family])


@pytest.mark.slow  # shares the HF launches
def test_train_through_the_cli_writes_the_same_run(runs, folders, tmp_path):
    """`scaletrain train model.hf=...` (the launch the other families skip): the same losses and final checkpoint
    as the trainer's loop in the shared launch."""
    args = ["train", *FAST, *STEPS, f"model.hf={folders['llama']}", "run.name=hf", "checkpoint.save_final=true"]
    run_cli([*args, "--nproc-per-node", "1"], tmp_path)
    got, want = losses(tmp_path / "runs/hf"), losses(runs / "fit" / "llama")
    assert len(got) == len(want) == 5
    for step, (a, b) in enumerate(zip(want, got), 1):
        assert abs(a - b) <= TOL, f"step {step}: {b} through the CLI vs {a}"
    assert (tmp_path / "runs/hf/checkpoints/step_00000005").is_dir()


def _file_keys_of(f: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(f), framework="pt") as h:
        return set(h.keys())


def _file_keys(folder: Path) -> set[str]:
    return set().union(*(_file_keys_of(f) for f in folder.glob("*.safetensors")))


def _refusal(overrides: list[str], world: int = 2) -> str:
    from scaletrain.config import load_config
    from scaletrain.resolve import resolve_job

    with pytest.raises(ValueError) as e:
        resolve_job(load_config(None, [*FAST, *overrides]), world)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_bad_input_is_one_line_before_launch(folders, tmp_path):
    # CLI: exit 2, one line, nothing started
    proc = run_cli(["train", f"model.hf={tmp_path}", "--nproc-per-node", "2"], tmp_path, check=False)
    assert proc.returncode == 2 and "has no config.json" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()
    # a real model's refusal: transformers imports torchao, whose failed .so loads and torch's pytree warnings
    # must not come before the one line
    moe = ["train", f"model.hf={folders['qwen3_moe']}", "parallel.tp=2", "parallel.dp_shard=1", "data.seq_len=64"]
    proc = run_cli([*moe, "--nproc-per-node", "2"], tmp_path, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith("scaletrain: error: parallel.tp: ")
    # in-process: the same checks resolve_job runs before any rank starts
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    assert "is not known to transformers" in _refusal([f"model.hf={tmp_path}"])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))  # an image classifier: the vision family
    assert "causal-lm feeds token ids, and the vision model takes none" in _refusal([f"model.hf={tmp_path}"])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "align"}))
    assert "is not a causal language model" in _refusal([f"model.hf={tmp_path}"])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 256}))
    assert "this architecture is not supported" in _refusal([f"model.hf={tmp_path}"])
    for family in NO_TP:
        assert "use parallel.tp=1" in _refusal([f"model.hf={folders[family]}", "parallel.tp=2", "parallel.dp_shard=1"])
    three = save_hf_folder(tmp_path / "kv3", {**FAMILIES["llama"], "num_key_value_heads": 1})
    assert "does not divide model.hf config.json's num_key_value_heads=1" in _refusal(
        [f"model.hf={three}", "parallel.tp=2", "parallel.dp_shard=1"]
    )
    assert "the shape comes from model.hf" in _refusal([f"model.hf={folders['llama']}", "model.dim=32"])
    # expert parallelism splits the built-in moe family's experts and transformers' packed [gate; up] ones
    # (tests/test_moe.py): a dense folder has none, gpt-oss keeps its experts transposed with biases
    ep2 = ["parallel.ep=2", "parallel.dp_shard=2"]
    assert "is dense (no experts); use parallel.ep=1" in _refusal([f"model.hf={folders['llama']}", *ep2])
    gpt_oss = save_hf_folder(tmp_path / "gpt_oss", GPT_OSS, weights=False)
    assert "experts are laid out in a way expert parallelism does not split" in _refusal([f"model.hf={gpt_oss}", *ep2])
    # weights whose shapes do not match config.json
    wrong = save_hf_folder(tmp_path / "wrong", FAMILIES["llama"])
    cfg = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    assert "config.json makes it [64, 96]; the weights and config.json describe different models" in _refusal(
        [f"model.hf={wrong}"]
    )


def test_plan_of_a_hf_job_config_ranks_layouts_and_prices_expert_parallelism(folders, tmp_path):
    """`scaletrain plan model.hf=FOLDER`: a dense folder gets ranked layouts; transformers' Qwen3-MoE gets the
    expert-parallel plan (a row per ep dividing its 4 experts; --ep picks, with --hf FOLDER too); --ep on experts expert parallelism does
    not split (gpt-oss: planned as dense) is one line (before: a traceback, every HF model took the expert-parallel
    planner's path)."""
    gpus = ["data.seq_len=64", "--gpu", "h100-sxm", "--gpus", "8", "--json"]
    out = run_cli_in_process(["plan", f"model.hf={folders['llama']}", *gpus], tmp_path)
    assert json.loads(out.stdout)["layouts"]
    out = run_cli_in_process(["plan", f"model.hf={folders['qwen3_moe']}", *gpus], tmp_path)
    rows = {r["ep"]: r for r in json.loads(out.stdout)["rows"]}
    assert sorted(rows) == [1, 2, 4] and rows[1]["a2a_seconds_per_step"] == 0 < rows[2]["a2a_seconds_per_step"]
    out = run_cli_in_process(["plan", f"model.hf={folders['qwen3_moe']}", *gpus, "--ep", "2"], tmp_path)
    assert [r["ep"] for r in json.loads(out.stdout)["rows"]] == [2]
    out = run_cli_in_process(["plan", "--hf", str(folders["qwen3_moe"]), *gpus[1:], "--ep", "1,4"], tmp_path)
    by_flag = json.loads(out.stdout)
    assert by_flag["model"] == "Qwen3MoeForCausalLM" and [r["ep"] for r in by_flag["rows"]] == [1, 4]
    gpt_oss = save_hf_folder(tmp_path / "gpt_oss", GPT_OSS, weights=False)
    ep = ["plan", f"model.hf={gpt_oss}", "--gpu", "h100-sxm", "--gpus", "8", "--ep", "2"]
    proc = run_cli_in_process(ep, tmp_path, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("scaletrain: error: --ep: gpt_oss's experts")
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_init_from_hf_refuses_what_the_built_in_llama_would_load_wrongly(folders, tmp_path):
    """The defects of issue 14: each was a different model loaded silently, or a traceback after launch."""
    llama = {**FAMILIES["llama"], "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4}
    rope = save_hf_folder(tmp_path / "rope", {**llama, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert "rope_theta=500000.0 (model: 10000.0)" in _refusal([f"checkpoint.init_from_hf={rope}"])
    tied = save_hf_folder(tmp_path / "tied", {**llama, "tie_word_embeddings": True})
    assert "sets tie_word_embeddings" in _refusal([f"checkpoint.init_from_hf={tied}"])
    vocab = save_hf_folder(tmp_path / "vocab", {**llama, "vocab_size": 512, "rms_norm_eps": 1e-5})
    assert "vocab_size=512 (model: 256)" in _refusal([f"checkpoint.init_from_hf={vocab}"])
    qwen2 = save_hf_folder(tmp_path / "qwen2", {**llama, "model_type": "qwen2"})
    assert "holds a 'qwen2' model, not Llama" in _refusal([f"checkpoint.init_from_hf={qwen2}"])
    assert "holds a 'gpt2' model" in _refusal([f"checkpoint.init_from_hf={folders['gpt2']}"])
    # each names the way that does load them exactly
    assert "model.hf=FOLDER" in _refusal([f"checkpoint.init_from_hf={rope}"])
