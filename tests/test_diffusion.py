"""Image generation through the same path as language models: the diffusion task (DDPM noise prediction) on
diffusers' own UNet2DModel, fed by `data prepare --format images`, with each image's noise and timestep drawn from
(seed, its stream position): DDP 2 and FSDP 2 per-step losses equal one process, the loss falls on a learnable set,
and `ckpt export --format diffusers` writes a pipeline folder diffusers loads with outputs equal to scaletrain's.
Images are generated here; models are tiny and built from config objects (nothing downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli_in_process

TOL = 1e-5
# a tiny UNet (2 levels, attention on the lower one) on 8-pixel images: seconds per run on 2 CPU cores
TINY = ["task.name=diffusion", "model.name=unet-tiny-diffusion", "model.sample_size=8",
        "model.block_out_channels=[8, 16]", "model.num_train_timesteps=100"]  # fmt: skip
# a tiny pixel-space DiT (always class-conditional): 2-pixel patches of the same images
DIT = ["task.name=diffusion", "model.name=dit-tiny-diffusion", "model.sample_size=8", "model.patch_size=2",
       "model.num_train_timesteps=100"]  # fmt: skip


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    from test_vision import make_tree, prepare

    tmp = tmp_path_factory.mktemp("diffusion_images")
    return prepare(tmp, make_tree(tmp / "tree", per_class=8, size=8))


def _resolve(overrides: list[str]):
    from scaletrain.config import load_config
    from scaletrain.resolve.job import resolve_job

    return resolve_job(load_config(None, overrides), 1)


def test_the_noise_of_a_sample_depends_only_on_the_seed_and_its_position(images):
    """Two ranks' shares of a step, with or without accumulation, are the one-process step's images with the same
    noise and timesteps: what makes every layout equal one process and a resumed run bit-identical."""
    import torch

    from scaletrain.data.images import ImageShards, Pixels
    from scaletrain.data.noised_images import NoisedImageLoader

    spec = _resolve([*TINY, f"data.path={images}", "train.global_batch_size=8"]).spec
    scheduler = spec.scheduler()

    def step(micro: int, rank: int, ranks: int, consumed: int = 0) -> list:
        loader = NoisedImageLoader(ImageShards(images, "train"), Pixels(8, 3, augment=False), 8, micro, rank, ranks,
                                   seed=3, scheduler=scheduler, conditional=True)  # fmt: skip
        loader.consumed_samples = consumed
        batches = loader.next_step()
        loader.close()
        return batches

    whole = step(8, 0, 1)[0]
    parts = [*step(2, 0, 2), *step(2, 1, 2)]
    for field in ("noisy", "timesteps", "labels", "target"):
        assert torch.equal(getattr(whole, field), torch.cat([getattr(b, field) for b in parts]))
    assert whole.timesteps.unique().numel() > 1 and whole.timesteps.max() < 100
    later = step(8, 0, 1, consumed=8)[0]  # the next step draws other noise
    assert not torch.equal(later.target, whole.target)


def test_bad_models_and_folders_are_one_line(tmp_path, images):
    from diffusers import UNet2DModel

    job = [f"data.path={images}", "train.global_batch_size=8"]
    UNet2DModel(sample_size=8, block_out_channels=(8, 16), norm_num_groups=8, layers_per_block=1,
                down_block_types=("DownBlock2D", "DownBlock2D"),
                up_block_types=("UpBlock2D", "UpBlock2D")).save_pretrained(tmp_path / "pipe" / "unet")  # fmt: skip
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps({"_class_name": "DDPMPipeline",
                                                                    "unet": ["diffusers", "UNet2DModel"]}))  # fmt: skip
    bad = {
        f"task.name=diffusion model.diffusers={tmp_path / 'pipe'}": f"model.diffusers: {tmp_path / 'pipe'} has no "
        f"scheduler (scheduler/scheduler_config.json); the diffusion task draws its noise from it: add one, e.g. "
        f"DDPMScheduler().save_pretrained('{tmp_path / 'pipe'}/scheduler')",
        "task.name=diffusion model.name=tiny": "task.name: diffusion trains a denoiser, and the llama model is not "
        "one; use a diffusion model (model.diffusers = a diffusers folder, or a preset such as unet-tiny-diffusion)",
        "task.name=diffusion model.name=unet-tiny-diffusion model.prediction_type=noise": "model.prediction_type: "
        "give epsilon, v_prediction or sample (got 'noise')",
        "task.name=diffusion model.name=unet-tiny-diffusion model.width=3": "model.width: the diffusion family's "
        "preset has no such field; it has attention_head_dim, beta_end, beta_schedule, beta_start, "
        "block_out_channels, down_block_types, in_channels, layers_per_block, norm_num_groups, num_train_timesteps, "
        "out_channels, prediction_type, sample_size, up_block_types",
    }
    for overrides, message in bad.items():
        with pytest.raises(ValueError) as e:
            _resolve([*job, *overrides.split()])
        assert str(e.value) == message
    # with its scheduler the folder is a model of this family, its weights read from unet/
    from diffusers import DDPMScheduler

    DDPMScheduler(num_train_timesteps=50).save_pretrained(tmp_path / "pipe" / "scheduler")
    index = json.loads((tmp_path / "pipe" / "model_index.json").read_text())
    (tmp_path / "pipe" / "model_index.json").write_text(
        json.dumps({**index, "scheduler": ["diffusers", "DDPMScheduler"]})
    )
    spec = _resolve([*job, "task.name=diffusion", f"model.diffusers={tmp_path / 'pipe'}"]).spec
    assert (spec.family, spec.model_name, spec.scheduler().config.num_train_timesteps) == (
        "diffusion",
        "UNet2DModel",
        50,
    )
    conditional = _resolve([*TINY, *job, "task.class_conditional=true"]).spec
    assert conditional.num_classes == 4  # the data's classes


@pytest.fixture(scope="module")
def layouts(images, tmp_path_factory):
    """One process and, in one 2-rank launch, DDP (with accumulation) and FSDP2: 5 steps each of a class-
    conditional UNet, and DDP, FSDP2 and TP 2 of a DiT (its first block's embedding, which the output layer calls
    again, its own FSDP unit; its heads and MLP split by TP); the one-process launch also trains the UNet with the trainer's loop (loss
    falling, a checkpoint to export)."""
    from test_parallel_layouts import launch_runner

    out = tmp_path_factory.mktemp("diffusion_layouts")
    base = [*TINY, f"data.path={images}", "train.global_batch_size=8", "train.lr=0.003",
            "task.class_conditional=true"]  # fmt: skip
    five = [*base, "train.steps=5"]
    dit = [*DIT, f"data.path={images}", "train.global_batch_size=8", "train.lr=0.003", "train.steps=5"]
    fit = [*base, "train.steps=40", "train.warmup_steps=3", "train.eval_batches=1", "train.eval_interval=0",
           f"run.output_dir={out}", "run.name=fit", "monitor.log_interval=1", "checkpoint.save_final=true"]  # fmt: skip
    launch_runner(1, {"single": [*five, "parallel.dp_shard=1"], "dit_single": [*dit, "parallel.dp_shard=1"],
                      "fit": [*fit, "parallel.dp_shard=1"]}, out, fit=frozenset({"fit"}))  # fmt: skip
    launch_runner(2, {"ddp2_accumulate": [*five, "parallel.dp_replicate=2", "train.micro_batch_size=2"],
                      "fsdp2": [*five, "parallel.dp_shard=2"], "dit_ddp2": [*dit, "parallel.dp_replicate=2", "parallel.dp_shard=1"],
                      "dit_fsdp2": [*dit, "parallel.dp_shard=2"], "dit_tp2": [*dit, "parallel.tp=2", "parallel.dp_shard=1"]},
                  out)  # fmt: skip
    return out


@pytest.mark.slow  # two launches (one process, two ranks)
def test_ddp_and_fsdp_losses_equal_one_process(layouts):
    from test_vision import assert_layouts_equal_one_process

    assert_layouts_equal_one_process(
        layouts, {"single": ("ddp2_accumulate", "fsdp2"), "dit_single": ("dit_ddp2", "dit_fsdp2", "dit_tp2")}
    )


@pytest.mark.slow  # shares the launches above
def test_the_diffusion_loss_falls(layouts):
    from scaletrain.monitor import read_jsonl

    records = [r for r in read_jsonl(layouts / "fit/metrics.jsonl") if "loss" in r]
    assert all("images_per_s" in r for r in records)
    first, last = records[:8], records[-8:]
    mean = lambda rs: sum(r["loss"] for r in rs) / len(rs)  # noqa: E731
    assert mean(last) < 0.85 * mean(first), [round(r["loss"], 3) for r in records]


@pytest.mark.slow  # shares the launches above
def test_export_diffusers_loads_as_a_pipeline_with_equal_outputs(layouts, tmp_path):
    import torch
    from diffusers import DiffusionPipeline

    from scaletrain.checkpoint.export import load_full_model_state

    ckpt = sorted((layouts / "fit" / "checkpoints").glob("step_*"))[-1]
    run_cli_in_process(["ckpt", "export", str(ckpt), "--format", "diffusers", "--out", str(tmp_path / "pipe")],
                       layouts)  # fmt: skip
    pipe = DiffusionPipeline.from_pretrained(str(tmp_path / "pipe"))
    assert type(pipe).__name__ == "DDPMPipeline" and pipe.scheduler.config.num_train_timesteps == 100
    state, spec = load_full_model_state(ckpt)
    assert spec is not None
    ours = spec.build("cpu").eval()
    ours.load_state_dict(state)
    gen = torch.Generator().manual_seed(0)
    x, t, labels = torch.randn(3, 3, 8, 8, generator=gen), torch.tensor([0, 40, 99]), torch.tensor([0, 1, 3])
    with torch.no_grad():
        theirs = pipe.unet.eval()(x, t, class_labels=labels).sample
        assert (theirs - ours(x, t, labels)).abs().max() <= TOL


def test_an_image_runs_diagnosis_and_report_speak_of_images(tmp_path):
    """A data-bound image run is advised on decoding, not token files, and its report charts images/s."""
    from test_monitor_diagnosis import _rec

    from scaletrain.monitor.diagnosis import diagnose, flagged
    from scaletrain.monitor.report import build_report

    rows = []
    for step in range(1, 8):
        row = _rec(step, data=0.05)
        row["images_per_s"] = row.pop("tokens_per_s") / 100
        rows.append(row)
    (found,) = flagged(diagnose(rows))
    assert found.rule == "data_loader_bound" and "task.decode_workers" in found.suggestion
    assert "token" not in found.suggestion
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 7, "images_per_s": 123.0}))
    html = build_report(tmp_path)
    assert "images/s" in html and "tokens/s" not in html and "123" in html
