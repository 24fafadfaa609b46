"""An independent reference for the trainer: a plain PyTorch loop, fed the very micro-batches the trainer's one-rank
run drew, gives the same per-step loss within 1e-5 over 10 steps with gradient accumulation, warmup, a decay
schedule and active clipping, for the built-in `tiny` Llama and an HF Llama folder (`model.hf=DIR`).

Every layout parity test compares a layout with the same trainer on one rank, so a bug every layout shares (loss
normalisation, clipping, the schedule) passes them all; this one does not. The reference takes from scaletrain only
the model's starting point (the built-in model: ModelSpec built on meta and filled by name; the HF family:
transformers' own `from_pretrained` on the saved folder, which is the trainer's starting point too) and the batches
(recorded from the trainer's loader by tests/reference_runner.py). It writes its own AdamW parameter groups, its
own learning rate per step from the schedule's definition, its own loss, accumulation and clipping
(`clip_grad_norm_`). Batches are checked for what the loader promises (shifted targets, micro-batches that add up to
the global batch, no sequence drawn twice), not replayed blindly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import torchrun
from test_hf_models import FAMILIES, save_hf_folder

# Worst measured (torch 2.13, transformers 5.25, 2 CPU cores): per-step loss 4.8e-7 (tiny), 3.6e-7 (hf_llama): a 20x
# margin. A trainer whose clip threshold is 10% off fails at step 5 (2e-4); a schedule one step ahead at step 1.
TOL = 1e-5
RUNNER = Path(__file__).resolve().parent / "reference_runner.py"
# Every hyper-parameter the reference needs is spelled here and given to the trainer as an override, so neither
# side relies on the other's defaults. Clip at 2.5: pre-clip norms run between about 1 and 4.5 here, so both
# clipped and unclipped steps are replayed (checked below).
HP = dict(
    steps=10,
    global_batch_size=8,
    micro_batch_size=2,  # 4 micro-batches per step on one rank
    lr=3e-3,
    min_lr_ratio=0.1,
    warmup_steps=3,
    weight_decay=0.1,
    beta1=0.9,
    beta2=0.95,
    eps=1e-8,
    grad_clip=2.5,
)
SEQ_LEN = 32
COMMON = [
    *(f"train.{k}={v}" for k, v in HP.items()),
    f"data.seq_len={SEQ_LEN}",
    "data.max_bytes=300000",
    "precision.dtype=fp32",
    "run.seed=0",
]
SCHEDULE = {"tiny": "cosine", "hf_llama": "linear"}  # one run of each decay shape


def lr_at(step: int, schedule: str) -> float:
    """The learning rate of optimizer step `step` (0-based), from the schedule's definition (TrainConfig: linear
    warmup capped at the run's length, then a decay to min_lr_ratio x the peak at the last step): the k-th warmup
    step runs at k/(warmup+1) of the peak (torchtitan's linear warmup), the first step after warmup at the peak,
    the last at min_lr_ratio x the peak, cosine or linear in between."""
    steps, peak, floor = HP["steps"], HP["lr"], HP["min_lr_ratio"]
    warmup = min(HP["warmup_steps"], steps)
    if step < warmup:
        return peak * (step + 1) / (warmup + 1)
    done = (step - warmup) / max(1, steps - 1 - warmup)  # 0 at the peak, 1 at the last step
    shape = 0.5 * (1 + math.cos(math.pi * done)) if schedule == "cosine" else 1 - done
    return peak * (floor + (1 - floor) * shape)


def builtin_tiny() -> torch.nn.Module:
    """The built-in tiny Llama as the trainer starts it: built on meta, filled by parameter name from run.seed."""
    from scaletrain.models.registry import preset_spec

    spec = preset_spec("tiny")
    model = spec.build("meta").to_empty(device="cpu")
    spec.init_weights(model, seed=0)
    return model.train()


def transformers_model(folder: Path) -> torch.nn.Module:
    """transformers' own model of the folder, with the folder's weights (what `model.hf=DIR` starts from)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.config.use_cache = False
    return model.train()


def logits_of(model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    out = model(inputs)
    return out.logits if hasattr(out, "logits") else out


def reference_run(model: torch.nn.Module, batches: list, schedule: str) -> list[dict]:
    """Plain PyTorch: AdamW (decay on matrices only, as the trainer documents), the lr set by hand each step,
    summed cross-entropy over the global batch's tokens, accumulated over micro-batches, clip_grad_norm_."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": HP["weight_decay"]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"])
    record = []
    for step, micro_batches in enumerate(batches):
        lr = lr_at(step, schedule)
        for group in opt.param_groups:
            group["lr"] = lr
        tokens = sum(targets.numel() for _, targets in micro_batches)  # the global batch's target tokens
        total = 0.0
        for inputs, targets in micro_batches:
            logits = logits_of(model, inputs)
            loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
            (loss_sum / tokens).backward()
            total += loss_sum.item()
        norm = torch.nn.utils.clip_grad_norm_(params, HP["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        record.append({"loss": total / tokens, "lr": lr, "grad_norm": float(norm)})
    return record


def check_batches(batches: list) -> None:
    """What the loader promises of a step, checked on what it handed out."""
    assert len(batches) == HP["steps"]
    seen: set[bytes] = set()
    for step, micro_batches in enumerate(batches, 1):
        assert len(micro_batches) == HP["global_batch_size"] // HP["micro_batch_size"], f"step {step}"
        for inputs, targets in micro_batches:
            assert inputs.shape == targets.shape == (HP["micro_batch_size"], SEQ_LEN), f"step {step}"
            assert torch.equal(inputs[:, 1:], targets[:, :-1]), f"step {step}: targets are not the next tokens"
            assert (targets >= 0).all(), f"step {step}: ignored targets (this job packs no documents)"
            for row in inputs:
                key = row.numpy().tobytes()
                assert key not in seen, f"step {step}: a sequence drawn twice"
                seen.add(key)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reference")
    hf_folder = save_hf_folder(root / "hf_llama_folder", FAMILIES["llama"])
    jobs = {
        "tiny": [*COMMON, "model.name=tiny", f"train.schedule={SCHEDULE['tiny']}"],
        "hf_llama": [*COMMON, f"model.hf={hf_folder}", f"train.schedule={SCHEDULE['hf_llama']}"],
    }
    spec = root / "jobs.json"
    spec.write_text(json.dumps([{"name": n, "overrides": o} for n, o in jobs.items()]))
    torchrun(1, [str(RUNNER), str(spec), str(root / "out")], cwd=root)
    return {"tiny": root / "out" / "tiny", "hf_llama": root / "out" / "hf_llama", "hf_folder": hf_folder}


@pytest.mark.parametrize("name", ["tiny", "hf_llama"])
def test_trainer_losses_equal_a_plain_pytorch_loop_on_the_same_batches(runs, name):
    trainer = json.loads((runs[name] / "steps.json").read_text())
    batches = torch.load(runs[name] / "batches.pt")
    check_batches(batches)
    torch.manual_seed(0)  # nothing random should remain; a stray dropout would then differ visibly
    model = builtin_tiny() if name == "tiny" else transformers_model(runs["hf_folder"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the trainer's process ran (conftest.torchrun): no oversubscribed shared cores
    try:
        ref = reference_run(model, batches, SCHEDULE[name])
    finally:
        torch.set_num_threads(threads)
    assert len(trainer) == len(ref) == HP["steps"]
    clipped = [r["grad_norm"] > HP["grad_clip"] for r in ref]
    assert any(clipped) and not all(clipped), f"{name}: clipped steps {clipped}: want both kinds replayed"
    assert ref[-1]["loss"] < ref[0]["loss"]  # it learns
    for step, (t, r) in enumerate(zip(trainer, ref, strict=True), 1):
        detail = f"lr {t['lr']:.6g} vs {r['lr']:.6g}, pre-clip norm {t['grad_norm']:.6g} vs {r['grad_norm']:.6g}"
        assert abs(t["loss"] - r["loss"]) <= TOL, (
            f"{name} step {step}: trainer {t['loss']} vs reference {r['loss']}; {detail}"
        )
        assert math.isclose(t["lr"], r["lr"], rel_tol=1e-12), f"{name} step {step}: {detail}"
