"""LoRA (peft adapters on a frozen base), fp32 on CPU: the trainer's adapted model is peft's model, only adapters
train (gradients, optimizer state, checkpoints), every layout equals one process, and the exported adapter folder
(peft) and merged model (transformers) give the trained model's logits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import FAST, run_cli, run_cli_in_process
from test_parallel_layouts import launch_runner, runner_losses

from scaletrain.config import load_config
from scaletrain.models.lora import add_lora, init_adapters
from scaletrain.models.naming import is_adapter_name, plain_param_name
from scaletrain.parallel.runtime import shutdown_distributed
from scaletrain.resolve import resolve_job

TOL = 1e-5
LORA = ["lora.rank=4", "lora.alpha=8", "train.lr=0.01"]
STEPS = 4


def _trainer(tmp_path: Path, extra: list[str] = ()):
    from scaletrain.train import Trainer

    cfg = load_config(None, [*FAST, f"train.steps={STEPS}", *LORA, f"run.output_dir={tmp_path}", *extra])
    return Trainer.build(cfg)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A one-process LoRA trainer after STEPS steps, with its frozen weights as they started."""
    trainer = _trainer(tmp_path_factory.mktemp("lora"))
    model = trainer.model.module
    start = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    grad_elements = []
    for _ in range(STEPS):
        mb = trainer.loader.next_step()
        from scaletrain.train.step import forward_backward, step_count

        count = step_count(trainer.job, trainer.task, mb)
        forward_backward(trainer.job, trainer.task, mb, trainer.layout.grad_average / count)
        grad_elements.append(sum(p.grad.numel() for p in model.parameters() if p.grad is not None))
        trainer.job.step(skip_nonfinite=False)
        trainer.scheduler.step()
    shutdown_distributed()  # Trainer.build's one-rank group: the tests below only read the trained tensors
    return trainer, start, grad_elements


def test_only_adapters_get_gradients_and_optimizer_state(trained):
    trainer, start, grad_elements = trained
    model = trainer.model.module
    adapters = {n: p for n, p in model.named_parameters() if is_adapter_name(plain_param_name(n))}
    assert adapters and all(p.requires_grad for p in adapters.values())
    adapter_elements = sum(p.numel() for p in adapters.values())
    assert grad_elements == [adapter_elements] * STEPS  # no gradient allocated for a frozen weight
    assert adapter_elements < sum(p.numel() for p in model.parameters()) // 10
    state_ids = {id(p) for p in trainer.job.optimizer.state}
    assert state_ids == {id(p) for p in adapters.values()}
    names = {plain_param_name(n) for n in adapters}
    assert any(".lora_B." in n for n in names) and any(".lora_A." in n for n in names)


def test_frozen_weights_bit_identical_after_training(trained):
    trainer, start, _ = trained
    now = dict(trainer.model.module.named_parameters())
    assert start and all(torch.equal(now[n], t) for n, t in start.items())
    assert any(float(p.detach().abs().sum()) > 0 for n, p in now.items() if ".lora_B." in n)  # the adapters did train


def test_the_adapted_model_is_peft_model(trained):
    """Our model (peft layers injected on the family's model) equals peft's own get_peft_model on the same base."""
    from peft import LoraConfig, get_peft_model

    trainer, _, _ = trained
    spec, ours = trainer.spec, trainer.model.module
    base = spec.build("meta")
    base.to_empty(device="cpu")
    spec.init_weights(base, trainer.cfg.run.seed)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=spec.lora_targets()))
    sd = {plain_param_name(k): v for k, v in ours.state_dict().items()}
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            key = plain_param_name(name.removeprefix("base_model.model."))
            p.copy_(sd[key])
    tokens = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(ours(tokens), peft_model(tokens), atol=TOL, rtol=0)


@pytest.mark.parametrize(
    "override, message",
    [
        ("lora.targets=['nothing_here']", "lora.targets: ['nothing_here'] match no module"),
        ("lora.rank=1000", "lora.rank: 1000 is larger than"),
        # the tiny preset's q projection: 128 x 128, 64 rows per FSDP shard of 2: 8192 weights, half a block
        ("lora.quantize=nf4", "lora.quantize: layers.0.attention.wq (64x128 rows per shard) is not made of whole NF4"),
        ("lora.quantize=nf4 parallel.tp=2", "lora.quantize: a 4-bit base is not split by tensor parallelism"),
        ("parallel.tp=2 lora.dropout=0.1", "lora.dropout: adapter dropout under tensor parallelism is not supported"),
    ],
)
def test_bad_lora_input_is_one_line(override, message):
    cfg = load_config(None, [*FAST, *LORA, *override.split()])
    with pytest.raises(ValueError) as e:
        resolve_job(cfg, 2)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_lora_exits_2_before_launch(tmp_path):
    """One line on stderr and nothing else (peft and torchao's import noise kept off it), exit 2, nothing written."""
    for bad in ("lora.targets=['nothing_here']", "lora.quantize=nf4"):
        proc = run_cli(["train", *FAST, *LORA, bad], tmp_path, check=False)
        assert proc.returncode == 2, proc.stderr[-2000:]
        line = proc.stderr.strip()
        assert line.startswith(f"scaletrain: error: {bad.split('=')[0]}:") and "\n" not in line, line
        assert not (tmp_path / "runs").exists()


# -- every layout equals one process --------------------------------------------------------------------------------
LAYOUTS = {
    "ddp": ["parallel.dp_replicate=2"],
    "fsdp": [],
    "pp": ["parallel.pp=2", "parallel.dp_shard=1", "train.micro_batch_size=4"],
    # adapters follow their base's split: colwise base -> A whole, B colwise; rowwise base -> A rowwise, B whole
    "tp_sp": ["parallel.tp=2", "parallel.dp_shard=1", "parallel.sequence_parallel=true"],
}
# 4 ranks: the TP-split adapters (above) inside FSDP2's shards of the 2-D mesh, the layout peers report as broken
LAYOUTS4 = {"tp2_fsdp2": ["parallel.tp=2", "parallel.dp_shard=2"]}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_layouts")
    jobs = {n: [f"train.steps={STEPS}", *LORA, *o] for n, o in LAYOUTS.items()}
    launch_runner(1, {"single": [f"train.steps={STEPS}", *LORA]}, out)
    launch_runner(2, jobs, out)
    return out


@pytest.fixture(scope="module")
def layouts4(layouts):
    """The 4-rank layouts, beside the 2-rank ones (one launch, slow tier only)."""
    launch_runner(4, {n: [f"train.steps={STEPS}", *LORA, *o] for n, o in LAYOUTS4.items()}, layouts)
    return layouts


@pytest.mark.parametrize(
    "layout", [pytest.param(n, marks=pytest.mark.slow) if n != "fsdp" else n for n in [*LAYOUTS, *LAYOUTS4]]
)
def test_layout_losses_equal_one_process(request, layouts, layout):
    if layout in LAYOUTS4:
        layouts = request.getfixturevalue("layouts4")
    ref, got = runner_losses(layouts / "single"), runner_losses(layouts / layout)
    assert len(ref) == len(got) == STEPS
    for step, (a, b) in enumerate(zip(ref, got), 1):
        assert abs(a - b) <= TOL, f"{layout} step {step}: {b} vs single-process {a}"
    base = torch.load(layouts / "single" / "state_rank0.pt")
    for rank_file in (layouts / layout).glob("state_rank*.pt"):
        for name, t in torch.load(rank_file).items():  # frozen base bit-identical, adapters as one process
            if is_adapter_name(name):
                assert torch.allclose(t, base[name], atol=TOL, rtol=0), name
            else:
                assert torch.equal(t, base[name]), name
    held = json.loads((layouts / layout / "optimizer_state.json").read_text())
    assert held and all(is_adapter_name(n) for n in held)  # optimizer state for the adapters only


# -- checkpoints: adapters only, resume after SIGKILL, export ---------------------------------------------------------
CKPT_STEPS = 8
CKPT = [
    f"train.steps={CKPT_STEPS}",
    *LORA,
    "train.eval_interval=0",
    "checkpoint.interval_steps=2",
    "checkpoint.save_final=true",
    "checkpoint.async_save=false",
    "--nproc-per-node",
    "1",
]


def _final(run: Path) -> Path:
    return run / "checkpoints" / f"step_{CKPT_STEPS:08d}"


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("lora_ckpt")
    run_cli(["train", *FAST, "run.name=clean", *CKPT], cwd)
    return cwd, cwd / "runs" / "clean"


def test_checkpoint_holds_adapters_and_names_its_base(clean_run):
    from scaletrain.checkpoint.adapters import read_adapters
    from scaletrain.models.lora import base_fingerprint

    _, run = clean_run
    manifest = json.loads((_final(run) / "manifest.json").read_text())
    spec = resolve_job(load_config(None, [*FAST, *LORA]), 1).spec
    assert manifest["lora"]["base"] == base_fingerprint(spec) and manifest["lora"]["rank"] == 4
    adapters = read_adapters(_final(run))
    assert adapters and all(is_adapter_name(n) for n in adapters)
    assert manifest["bytes"] < 4 * spec.num_params()  # less than the fp32 base alone: the base is not in it


def _kill_at_then_resume(job: list[str], cwd: Path, step: int, env: dict | None = None) -> Path:
    """`scaletrain` JOB (run.name=killed) SIGKILLed once its step-`step` checkpoint is committed, then the same
    command again, which resumes; returns the run's checkpoints folder."""
    args = [sys.executable, "-m", "scaletrain.cli.main", *job]
    # its own session: the SIGKILL takes the launcher and its rank at once, as a lost node would
    proc = subprocess.Popen(
        args, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    ckpts = cwd / "runs" / "killed" / "checkpoints"
    deadline = time.monotonic() + 300
    while not (ckpts / f"step_{step:08d}").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, f"no step-{step} checkpoint"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    finals = sorted(ckpts.glob("step_*"))
    run_cli(job, cwd, env=env)
    assert "resumed from" in (cwd / "runs" / "killed" / "logs" / "rank0.log").read_text()
    assert finals[-1].name != sorted(ckpts.glob("step_*"))[-1].name  # killed before its last step
    return ckpts


@pytest.mark.slow
def test_resume_after_sigkill_bit_identical(clean_run):
    from scaletrain.checkpoint.adapters import read_adapters

    cwd, ref = clean_run
    _kill_at_then_resume(["train", *FAST, "run.name=killed", *CKPT], cwd, 4)
    got, want = read_adapters(_final(cwd / "runs" / "killed")), read_adapters(_final(ref))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _load_adapters(model: torch.nn.Module, ckpt: Path) -> None:
    """The checkpoint's adapter weights copied into `model` (the adapted model in one process), by plain name."""
    from scaletrain.checkpoint.adapters import read_adapters

    adapters = read_adapters(ckpt)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if plain_param_name(name) in adapters:
                p.copy_(adapters[plain_param_name(name)])


def test_export_peft_and_merged_hf_give_the_trained_logits(clean_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from scaletrain.checkpoint.adapters import base_state

    _, run = clean_run
    ckpt = _final(run)
    run_cli_in_process(["ckpt", "export", str(ckpt), "--format", "peft", "--out", str(tmp_path / "peft")], tmp_path)
    run_cli_in_process(["ckpt", "export", str(ckpt), "--format", "hf", "--out", str(tmp_path / "hf")], tmp_path)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    cfg = load_config(None, [*FAST, *LORA])
    spec = resolve_job(cfg, 1).spec
    # ours: the family's model with the checkpoint's adapters
    ours = add_lora(spec.build("meta"), cfg.lora, spec)
    ours.to_empty(device="cpu")
    spec.init_weights(ours, cfg.run.seed)
    init_adapters(ours, cfg.run.seed)
    _load_adapters(ours, ckpt)
    base = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in spec.hf.config().items() if k != "architectures"}))
    base.load_state_dict(spec.hf.to_hf(base_state(spec, manifest["lora"])), strict=False)
    with_peft = PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    tokens = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ours(tokens)
        assert float(want.std()) > 0
        assert torch.allclose(with_peft(tokens).logits, want, atol=TOL, rtol=0)
        assert torch.allclose(merged(tokens).logits, want, atol=TOL, rtol=0)


def test_export_onto_another_base_is_refused(clean_run, tmp_path):
    _, run = clean_run
    import shutil

    ckpt = tmp_path / "step_copy"
    shutil.copytree(_final(run), ckpt)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["lora"]["base"] = "0" * 64
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "out"
    proc = run_cli_in_process(
        ["ckpt", "export", str(ckpt), "--format", "peft", "--out", str(out)], tmp_path, check=False
    )
    assert proc.returncode == 2 and "trained on another base" in proc.stderr
    assert not out.exists()


# -- a Hugging Face family (qwen3: q/k norms, tied embedding) ----------------------------------------------------
@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    from test_hf_models import FAMILIES, STEPS as HF_STEPS, save_hf_folder

    out = tmp_path_factory.mktemp("lora_hf")
    folder = save_hf_folder(out / "qwen3", FAMILIES["qwen3"])
    job = [*HF_STEPS, f"model.hf={folder}", *LORA]
    fit = [f"run.output_dir={out / 'fit'}", "run.name=qwen3", "checkpoint.save_final=true"]
    launch_runner(1, {"single": [*job, "parallel.dp_shard=1"], "fit": [*job, *fit]}, out, fit=frozenset({"fit"}))
    return out, folder


def test_hf_family_export_peft_and_merged_give_equal_logits(hf_runs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out, folder = hf_runs
    ckpt = out / "fit" / "qwen3" / "checkpoints" / "step_00000005"
    for fmt in ("peft", "hf"):
        run_cli_in_process(["ckpt", "export", str(ckpt), "--format", fmt, "--out", str(tmp_path / fmt)], tmp_path)
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(folder)
    base = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    tokens = torch.randint(0, base.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = base(tokens).logits.clone()
        with_peft = PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
        adapted = with_peft(tokens).logits
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()(tokens).logits
    assert not torch.allclose(adapted, before, atol=1e-4)  # the adapters trained and were loaded
    assert torch.allclose(adapted, merged, atol=TOL, rtol=0)
    assert len(runner_losses(out / "single")) == 5


# -- QLoRA: the adapted layers' frozen base in 4-bit NormalFloat (torchao's NF4Tensor), sharded by FSDP2 -----------
# dims whose projections are whole NF4 blocks (64 x 256 weights) in each of 2 (and 4) FSDP shards
QLORA = ["model.dim=256", "model.ffn_dim=512", "model.n_kv_heads=4", *LORA, "lora.quantize=nf4"]
QLORA_LAYOUTS = {
    "fsdp": [],
    "ddp": ["parallel.dp_replicate=2"],
    "pp": ["parallel.pp=2", "parallel.dp_shard=1", "train.micro_batch_size=4"],
}
QLORA_LAYOUTS4 = {"hsdp": ["parallel.dp_replicate=2", "parallel.dp_shard=2"]}
QLORA_CKPT = [
    "train.eval_interval=0",
    "checkpoint.interval_steps=2",
    "checkpoint.save_final=true",
    "checkpoint.async_save=false",
]


def _nf4_bytes(t) -> int:
    """Bytes an NF4 tensor stores: its 4-bit codes, block scales and their own scales (torchao's inner tensors)."""
    return sum(getattr(t, name).nbytes for name in t.__tensor_flatten__()[0])


class QloraRuns:
    """One process (bare steps; the trainer's own loop with checkpoints; the same job on a full-precision base) and
    FSDP2 on 2 ranks, launched at once; the slow tier's other layouts in one launch per rank count, when asked."""

    def __init__(self, out: Path):
        self.out, steps = out, f"train.steps={STEPS}"
        fit = [steps, *QLORA, *QLORA_CKPT, f"run.output_dir={out / 'fit'}", "run.name=qlora", "parallel.dp_shard=1"]
        single = {"single": [steps, *QLORA], "fit": fit, "plain_base": [steps, *QLORA[:-1]]}
        launch_runner(1, single, out, fit=frozenset({"fit"}))
        launch_runner(2, {"fsdp": [steps, *QLORA]}, out)

    def __truediv__(self, name: str) -> Path:
        if not (self.out / name).exists():
            group = (
                QLORA_LAYOUTS4 if name in QLORA_LAYOUTS4 else {n: o for n, o in QLORA_LAYOUTS.items() if n != "fsdp"}
            )
            nproc = 4 if name in QLORA_LAYOUTS4 else 2
            launch_runner(nproc, {n: [f"train.steps={STEPS}", *QLORA, *o] for n, o in group.items()}, self.out)
        return self.out / name


@pytest.fixture(scope="module")
def qlora(tmp_path_factory):
    return QloraRuns(tmp_path_factory.mktemp("qlora"))


@pytest.mark.parametrize(
    "layout", [pytest.param(n, marks=pytest.mark.slow) if n != "fsdp" else n for n in [*QLORA_LAYOUTS, *QLORA_LAYOUTS4]]
)
def test_qlora_layouts_equal_one_process(qlora, layout):
    """Every layout computes with the single process's 4-bit base (quantized whole, each rank its rows): equal
    losses, an NF4 base bit-identical after training, adapters as one process, optimizer state for adapters only."""
    ref, got = runner_losses(qlora / "single"), runner_losses(qlora / layout)
    assert len(ref) == len(got) == STEPS
    for step, (a, b) in enumerate(zip(ref, got), 1):
        assert abs(a - b) <= TOL, f"{layout} step {step}: {b} vs single-process {a}"
    base = torch.load(qlora / "single" / "state_rank0.pt", weights_only=False)
    files = list((qlora / layout).glob("state_rank*.pt"))
    assert files
    for rank_file in files:
        for name, t in torch.load(rank_file, weights_only=False).items():
            if is_adapter_name(name):
                assert torch.allclose(t, base[name], atol=TOL, rtol=0), name
            else:  # the 4-bit base as it computes (full_state_dict dequantizes it) and the rest, bit-identical
                assert torch.equal(t, base[name]), name
    held = json.loads((qlora / layout / "optimizer_state.json").read_text())
    assert held and all(is_adapter_name(n) for n in held)


def _qlora_model(cfg, spec):
    """The job's adapted model in one process, its base filled and quantized as the trainer does."""
    from scaletrain.models.lora import fill_base

    model = add_lora(spec.build("meta"), cfg.lora, spec)
    model.to_empty(device="cpu")
    fill_base(model, lambda m: spec.init_weights(m, cfg.run.seed))
    init_adapters(model, cfg.run.seed)
    return model


def test_qlora_base_is_four_bit_and_trains(qlora):
    """The adapted projections' base is NF4 (about 4.1 bits a weight: 4-bit codes, an 8-bit scale per 64 weights, a
    32-bit scale per 256 scales), quantized whole from the very weights a full-precision run starts from, and the
    trainer computes with those values; the rest stays fp32. Training moves the loss, close to the same job on the
    full-precision base but not equal to it."""
    from scaletrain.models.lora import nf4_round_trip

    cfg = load_config(None, [*FAST, *QLORA])
    spec = resolve_job(cfg, 1).spec
    model = _qlora_model(cfg, spec)
    nf4 = {plain_param_name(n): p for n, p in model.named_parameters() if type(p).__name__ == "NF4Tensor"}
    assert len(nf4) == len(spec.lora_targets()) * 4  # 7 projections x 4 blocks
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if plain_param_name(n) not in nf4)
    trained = torch.load(qlora / "single" / "state_rank0.pt")  # base frozen: as it started
    plain = torch.load(qlora / "plain_base" / "state_rank0.pt")
    for name, t in nf4.items():
        assert _nf4_bytes(t) * 8 / t.numel() < 4.2, name  # vs 32 bits a weight in fp32
        assert torch.equal(t.get_original_weight(), nf4_round_trip(plain[name])), name
        assert torch.equal(trained[name], t.get_original_weight()), name
        assert not torch.equal(trained[name], plain[name]), name
    ours, full = runner_losses(qlora / "single"), runner_losses(qlora / "plain_base")
    assert ours[-1] < ours[0] and ours != full
    assert all(abs(a - b) < 0.05 * b for a, b in zip(ours, full))


def test_qlora_checkpoint_holds_adapters_and_merged_export_gives_the_trained_logits(qlora, tmp_path):
    """A QLoRA checkpoint is adapters only (and says its base was 4-bit); `ckpt export --format hf` merges them into
    the 4-bit base's values, so transformers' model of the folder gives the trained model's logits."""
    from transformers import AutoModelForCausalLM

    ckpt = qlora / "fit" / "qlora" / "checkpoints" / f"step_{STEPS:08d}"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    cfg = load_config(None, [*FAST, *QLORA])
    spec = resolve_job(cfg, 1).spec
    assert manifest["lora"]["quantize"] == "nf4" and manifest["bytes"] < spec.num_params()  # < 1 byte a weight
    run_cli_in_process(["ckpt", "export", str(ckpt), "--format", "hf", "--out", str(tmp_path / "hf")], tmp_path)
    ours = _qlora_model(cfg, spec)
    _load_adapters(ours, ckpt)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    tokens = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ours(tokens)
        assert float(want.std()) > 0
        assert torch.allclose(merged(tokens).logits, want, atol=TOL, rtol=0)


@pytest.mark.slow
def test_qlora_hf_family_from_its_folder_equal_on_every_layout(tmp_path):
    """QLoRA on a Hugging Face family (qwen3: q/k norms, tied embedding) whose base comes from its folder's weights:
    quantized once read, FSDP2 and DDP equal one process."""
    from test_hf_models import DECODER, STEPS as HF_STEPS, save_hf_folder

    dims = {**DECODER, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4}
    folder = save_hf_folder(tmp_path / "qwen3", dict(model_type="qwen3", **dims, head_dim=64, tie_word_embeddings=True))
    job = [*HF_STEPS, f"model.hf={folder}", *LORA, "lora.quantize=nf4"]
    launch_runner(1, {"single": [*job, "parallel.dp_shard=1"]}, tmp_path)
    launch_runner(2, {"fsdp": job, "ddp": [*job, "parallel.dp_replicate=2", "parallel.dp_shard=1"]}, tmp_path)
    ref = runner_losses(tmp_path / "single")
    assert len(ref) == 5 and ref[-1] < ref[0]
    for layout in ("fsdp", "ddp"):
        got = runner_losses(tmp_path / layout)
        assert len(got) == len(ref) and all(abs(a - b) <= TOL for a, b in zip(ref, got)), (layout, got, ref)


@pytest.mark.slow
def test_qlora_resume_after_sigkill_bit_identical(qlora, tmp_path):
    """A QLoRA run killed after its step-2 checkpoint resumes (the 4-bit base quantized again from the same weights)
    to the very adapters of the unbroken run (the fixture's, trained by the same loop in one process)."""
    from scaletrain.checkpoint.adapters import read_adapters

    job = ["train", *FAST, f"train.steps={STEPS}", *QLORA, *QLORA_CKPT, "run.name=killed", "--nproc-per-node", "1"]
    # one thread, as the runner's ranks: the same summation order
    ckpts = _kill_at_then_resume(job, tmp_path, 2, env={"OMP_NUM_THREADS": "1"})
    got = read_adapters(ckpts / f"step_{STEPS:08d}")
    want = read_adapters(qlora / "fit" / "qlora" / "checkpoints" / f"step_{STEPS:08d}")
    assert got and got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_generate_on_a_lora_and_a_qlora_run_uses_the_merged_model(clean_run, qlora, tmp_path):
    """`scaletrain generate RUN` (and eval, lm-eval: the same weights) on an adapter checkpoint runs the model the
    adapters trained: the base rebuilt from the run (4-bit values for QLoRA) with the adapters merged in."""
    from scaletrain.checkpoint.adapters import merged_state
    from scaletrain.checkpoint.export import load_full_model_state

    for run, overrides in ((clean_run[1], [*FAST, *LORA]), (qlora / "fit" / "qlora", [*FAST, *QLORA])):
        proc = run_cli_in_process(["generate", str(run), "--prompt", "def ", "--max-new-tokens", "4"], tmp_path)
        assert proc.stdout.strip() or proc.stdout.count("\n") >= 1  # a completion (this tiny model's: any bytes)
        ckpt = max((run / "checkpoints").glob("step_*"))
        weights, spec = load_full_model_state(ckpt)
        manifest = json.loads((ckpt / "manifest.json").read_text())
        want = merged_state(ckpt, spec, manifest["lora"])
        assert weights.keys() == want.keys() and all(torch.equal(weights[k], want[k]) for k in want)
        plain = resolve_job(load_config(None, overrides), 1).spec
        assert set(weights) == {plain_param_name(n) for n in plain.build("meta").state_dict()}
