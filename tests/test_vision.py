"""Image classification through the same path as language models: `data prepare --format images` (WebDataset tar
shards a plain tar reader reads, bad input refused in one line), the image-classification task on transformers'
vision models (a ViT preset, a folder's config), DDP 2 and FSDP 2 per-step losses equal to one process, accuracy
above chance on a learnable synthetic task, and a user's own module through model.factory. Images are generated
here; models are tiny and built from config objects (nothing downloaded)."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli_in_process

COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30)]  # one class each: learnable from pixels
TOL = 1e-5


def make_tree(root: Path, per_class: int = 24, size: int = 36, seed: int = 0) -> Path:
    """A class-per-folder tree of noisy PNGs whose class is their mean colour."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for k, colour in enumerate(COLOURS):
        folder = root / f"class{k}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = np.array(colour)[None, None] + rng.normal(0, 40, (size, size, 3))
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(folder / f"{i}.png")
    return root


def prepare(tmp: Path, source: Path, *extra: str) -> Path:
    out = tmp / "data"
    args = ["data", "prepare", str(source), "--out", str(out), "--format", "images", "--val-share", "0.2", *extra]
    run_cli_in_process(args, tmp)
    return out


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("images")
    return prepare(tmp, make_tree(tmp / "tree"), "--shard-images", "40")


def test_prepare_writes_tar_shards_other_tools_read(images):
    manifest = json.loads((images / "manifest.json").read_text())
    assert manifest["format"] == "images" and manifest["classes"] == ["class0", "class1", "class2", "class3"]
    train, val = manifest["splits"]["train"], manifest["splits"]["val"]
    assert train["samples"] + val["samples"] == 96 and val["samples"] > 0 and len(train["shards"]) == 2
    # a plain tar reader sees WebDataset samples: KEY.png + KEY.cls sharing a key
    with tarfile.open(images / train["shards"][0]["tar"]) as tar:
        names = tar.getnames()
        assert len(names) == 2 * train["shards"][0]["samples"]
        key = names[0].split(".")[0]
        assert names[:2] == [f"{key}.png", f"{key}.cls"]
        label = int(tar.extractfile(names[1]).read())  # type: ignore[union-attr]
        png = tar.extractfile(names[0]).read()  # type: ignore[union-attr]
    from scaletrain.data.images import ImageShards

    shards = ImageShards(images, "train")
    assert shards.read(0) == (png, label)  # the index points at the same bytes
    shards.close()


def test_prepare_from_jsonl_and_bad_input_in_one_line(tmp_path):
    tree = make_tree(tmp_path / "tree", per_class=3)
    lines = [
        json.dumps({"path": str(p.relative_to(tmp_path)), "label": p.parent.name}) for p in sorted(tree.rglob("*.png"))
    ]
    (tmp_path / "list.jsonl").write_text("\n".join(lines) + "\n")
    out = prepare(tmp_path, tmp_path / "list.jsonl")
    assert json.loads((out / "manifest.json").read_text())["num_labels"] == 4

    (tree / "class9").mkdir()
    bad = run_cli_in_process(["data", "prepare", str(tree), "--out", "x", "--format", "images"], tmp_path, check=False)
    assert bad.returncode == 2 and bad.stderr.strip() == (
        f"scaletrain: error: {tree / 'class9'}: empty class folder (no .png, .jpg, .jpeg, .bmp, .gif, .webp, .tif, "
        ".tiff, .ppm files); add images or remove the folder"
    )
    (tree / "class9").rmdir()
    (tree / "class0" / "broken.png").write_bytes(b"not a png")
    bad = run_cli_in_process(["data", "prepare", str(tree), "--out", "x", "--format", "images"], tmp_path, check=False)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert bad.stderr.startswith(f"scaletrain: error: {tree / 'class0' / 'broken.png'}: not a readable image")
    args = ["data", "prepare", str(tree), "--out", "skipped", "--format", "images", "--skip-bad-images"]
    ok = run_cli_in_process(args, tmp_path)
    assert "1 unreadable image(s) skipped" in ok.stdout
    assert json.loads((tmp_path / "skipped/manifest.json").read_text())["skipped_images"] == 1


def _resolve(overrides: list[str]):
    from scaletrain.config import load_config
    from scaletrain.resolve.job import resolve_job

    return resolve_job(load_config(None, overrides), 1)


def test_the_task_takes_its_classes_from_the_data_and_refuses_a_mismatch(images):
    job = ["task.name=image-classification", f"data.path={images}", "train.global_batch_size=8"]
    spec = _resolve([*job, "model.name=vit-tiny-image"]).spec
    assert spec.family == "vision" and spec.num_labels == 4
    assert spec.config.id2label == {0: "class0", 1: "class1", 2: "class2", 3: "class3"}
    bad = {
        "model.name=vit-tiny-image task.image_size=64": "task.image_size: 64 does not match the model's image_size 32 "
        "(its position embeddings fix it); set task.image_size=32 or change model.image_size",
        "model.name=vit-tiny-image model.num_labels=3": "model.num_labels: the data has 4 classes, the model's head "
        "3; raise model.num_labels or leave it unset to take the data's",
        "model.name=vit-tiny-image model.hidden_size=x": "model.hidden_size: expected int (got 'x')",
        "model.name=tiny": "task.name: image-classification feeds images, and the llama model is not an image "
        "classifier; use a vision model (model.hf = a vision folder, a preset such as vit-tiny-image, or "
        "model.factory)",
    }
    for overrides, message in bad.items():
        with pytest.raises(ValueError) as e:
            _resolve([*job, *overrides.split()])
        assert str(e.value) == message


def test_model_hf_folder_with_a_vision_config_is_the_vision_family(tmp_path, images):
    from transformers import ConvNextConfig

    ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=7).save_pretrained(
        tmp_path / "convnext"
    )
    job = ["task.name=image-classification", f"data.path={images}", "train.global_batch_size=8"]
    spec = _resolve([*job, f"model.hf={tmp_path / 'convnext'}", "task.image_size=32"]).spec
    assert (spec.family, spec.architecture, spec.num_labels) == ("vision", "ConvNextForImageClassification", 4)


# a user's own module, importable from the ranks' PYTHONPATH: model.factory = "my_cnn:small_cnn"
USER_MODULE = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)

    def forward(self, x):
        return x + torch.relu(self.conv(x))


class SmallCNN(nn.Module):
    def __init__(self, num_labels, width):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, stride=2, padding=1)
        self.blocks = nn.ModuleList([Block(width) for _ in range(2)])
        self.head = nn.Linear(width, num_labels)

    def forward(self, pixels):
        x = self.stem(pixels)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def small_cnn(num_labels, width=8):
    return SmallCNN(num_labels, width)
"""


@pytest.fixture(scope="module")
def layouts(images, tmp_path_factory):
    """One process and, in one 2-rank launch, DDP (with accumulation), FSDP2 and TP 2: 5 steps each of a ViT and of a
    user's own module (model.factory); the one-process launch also trains the ViT with the trainer's loop to
    its validation accuracy."""
    import os

    from test_parallel_layouts import launch_runner

    out = tmp_path_factory.mktemp("layouts")
    (out / "my_cnn.py").write_text(USER_MODULE)
    base = ["task.name=image-classification", f"data.path={images}", "train.global_batch_size=8", "train.lr=0.003"]
    vit = [*base, "model.name=vit-tiny-image", "train.steps=5"]
    cnn = [*base, "model.factory=my_cnn:small_cnn", "model.width=8", "task.image_size=32", "train.steps=5"]
    fit = [*base, "model.name=vit-tiny-image", "train.steps=30", "train.warmup_steps=3", "train.eval_batches=2",
           f"run.output_dir={out}", "run.name=fit", "monitor.log_interval=10"]  # fmt: skip
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(out), old]))  # the ranks import my_cnn
    try:
        single = {"single": [*vit, "parallel.dp_shard=1"], "cnn_single": [*cnn, "parallel.dp_shard=1"],
                  "fit": [*fit, "parallel.dp_shard=1"]}  # fmt: skip
        launch_runner(1, single, out, fit=frozenset({"fit"}))
        layouts = {
            "ddp2_accumulate": [*vit, "parallel.dp_replicate=2", "train.micro_batch_size=2"],
            "fsdp2": [*vit, "parallel.dp_shard=2"],
            "cnn_fsdp2": [*cnn, "parallel.dp_shard=2"],
            "tp2": [*vit, "parallel.tp=2", "parallel.dp_shard=1"],
        }
        launch_runner(2, layouts, out)
    finally:
        os.environ["PYTHONPATH"] = old
    return out


def assert_layouts_equal_one_process(layouts: Path, groups: dict[str, tuple[str, ...]]) -> None:
    """Each launch named in `groups` ({one-process run: its layouts' runs}) has the 5 per-step losses of its
    one-process run within TOL."""
    from test_parallel_layouts import runner_losses

    for ref_name, names in groups.items():
        ref = runner_losses(layouts / ref_name)
        assert len(ref) == 5
        for name in names:
            got = runner_losses(layouts / name)
            for step, (a, b) in enumerate(zip(ref, got, strict=True), 1):
                assert abs(a - b) <= TOL, f"{name} step {step}: {b} vs one process {a}"


@pytest.mark.slow  # two launches (one process, two ranks)
def test_ddp_fsdp_and_tp_losses_equal_one_process(layouts):
    assert_layouts_equal_one_process(
        layouts, {"single": ("ddp2_accumulate", "fsdp2", "tp2"), "cnn_single": ("cnn_fsdp2",)}
    )


@pytest.mark.slow  # shares the launches above
def test_training_learns_the_synthetic_classes(layouts):
    from scaletrain.monitor import read_jsonl

    records = read_jsonl(layouts / "fit/metrics.jsonl")
    accuracy = [r["val_accuracy"] for r in records if "val_accuracy" in r]
    assert accuracy and accuracy[-1] > 0.5, records[-3:]  # chance: 0.25 (4 classes)
    assert all("images_per_s" in r for r in records if "loss" in r)


def test_a_factory_that_does_not_import_is_one_line(tmp_path, images):
    from click.testing import CliRunner

    from scaletrain.cli.main import main

    args = ["train", "task.name=image-classification", f"data.path={images}", "model.factory=no_such_pkg.nets:cnn"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        "scaletrain: error: model.factory: cannot import 'no_such_pkg.nets' (ModuleNotFoundError: No module named "
        "'no_such_pkg'); put its folder on PYTHONPATH or fix the module"
    )


RESUME_STEPS = 30  # checkpoints every 5: a kill after step 8 resumes from 5 or later
RESUME_JOB = ["task.name=image-classification", "model.name=vit-tiny-image", "model.hidden_size=64",
              "model.num_hidden_layers=2", "model.intermediate_size=128", f"train.steps={RESUME_STEPS}",
              "train.global_batch_size=8", "train.lr=0.003", "train.eval_interval=0", "train.eval_batches=1",
              "monitor.log_interval=1", "monitor.progress=false", "checkpoint.interval_steps=5",
              "checkpoint.save_final=true", "--nproc-per-node", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def clean_run(images, tmp_path_factory):
    from conftest import run_cli

    cwd = tmp_path_factory.mktemp("resume")
    run_cli(["train", *RESUME_JOB, f"data.path={images}", "run.name=clean"], cwd)
    return cwd


def _final_state(run: Path) -> dict:
    from scaletrain.checkpoint.export import load_full_model_state

    return load_full_model_state(run / "checkpoints" / f"step_{RESUME_STEPS:08d}")[0]


@pytest.mark.slow  # a 2-rank launch killed and restarted, plus the clean reference
def test_sigkill_mid_run_resumes_bit_identical_with_the_data_position(clean_run, images):
    import os
    import signal

    import torch
    from test_checkpoint import _start, _wait_for_step, _workers

    from conftest import losses

    proc = _start(["train", *RESUME_JOB, f"data.path={images}", "run.name=killed", "launch.max_restarts=2"],
                  clean_run)  # fmt: skip
    reached = _wait_for_step(clean_run / "runs/killed", 8, proc)
    os.kill(_workers(clean_run / "runs/killed")[-1], signal.SIGKILL)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "resumed from" in err, err[-3000:]
    assert reached < RESUME_STEPS
    got, want = _final_state(clean_run / "runs/killed"), _final_state(clean_run / "runs/clean")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert losses(clean_run / "runs/killed") == losses(clean_run / "runs/clean")  # same images, same augmentation


@pytest.mark.slow  # shares the clean run above
def test_export_hf_loads_in_transformers_with_equal_logits(clean_run, tmp_path):
    import torch
    from transformers import AutoModelForImageClassification

    from scaletrain.checkpoint.export import load_full_model_state

    ckpt = clean_run / "runs/clean/checkpoints" / f"step_{RESUME_STEPS:08d}"
    run_cli_in_process(["ckpt", "export", str(ckpt), "--format", "hf", "--out", str(tmp_path / "hf")], clean_run)
    hf = AutoModelForImageClassification.from_pretrained(str(tmp_path / "hf")).eval()
    assert hf.config.id2label == {0: "class0", 1: "class1", 2: "class2", 3: "class3"}
    state, spec = load_full_model_state(ckpt)
    assert spec is not None
    ours = spec.build("cpu").eval()
    ours.load_state_dict(state)
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(hf(pixel_values=pixels).logits, ours(pixels))


def test_setup_records_a_live_image_classifier_so_its_checkpoint_exports_as_hf(tmp_path):
    """scaletrain.setup() on a user's transformers classifier records the vision spec (job.save's manifest): it
    rebuilds from the manifest and writes the model's own config.json."""
    from transformers import ViTConfig, ViTForImageClassification

    from scaletrain.api import _transformers_spec
    from scaletrain.models.registry import spec_from_manifest

    config = ViTConfig(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=32, num_labels=5)  # fmt: skip
    spec = _transformers_spec(ViTForImageClassification(config))
    assert spec is not None and spec.family == "vision"
    rebuilt = spec_from_manifest(json.loads(json.dumps(spec.manifest())))
    assert rebuilt.hf is not None and (tmp_path / "config.json") in rebuilt.hf.write_config(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == ["ViTForImageClassification"] and len(written["id2label"]) == 5
