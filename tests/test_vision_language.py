"""The vision-language task through the same path as language models: `data prepare --format image-text` (the
image shards with the row's caption or chat beside each image), a LLaVA-style model (transformers'
LlavaForConditionalGeneration: a tiny CLIP vision tower and a tiny Llama, built from config objects here, with a
word-level tokenizer and a PIL image processor saved as its AutoProcessor) through `model.hf`, the loss on answer
tokens only, freeze policies, DDP 2 and FSDP 2 per-step losses equal to one
process, learning captions that are a function of the image, and the `ckpt export --format hf` folder (with the
frozen weights the checkpoint leaves out) loading in transformers with equal logits. Images are generated here;
nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli_in_process

COLOURS = {"red": (220, 20, 20), "green": (20, 220, 20), "blue": (20, 20, 220)}  # the caption names the colour
TOL = 1e-5
VOCAB = ["<pad>", "<s>", "</s>", "<unk>", "<image>", *"abcdefghijklmnopqrstuvwxyz:. ?!"]  # 36, an even vocabulary


def make_vlm(folder: Path, image_size: int = 16, processor_size: int | None = None) -> Path:
    """A LLaVA folder: config.json (CLIP 16 px, patch 4 -> 16 image tokens; Llama 2 layers) and its processor."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    vocab = {c: i for i, c in enumerate(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token per character
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", extra_special_tokens={"image_token": "<image>"})  # fmt: skip
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
        "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}"
        "{% endfor %}{% endif %}{% if m['role'] == 'assistant' %}</s>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    vision = CLIPVisionConfig(image_size=image_size, patch_size=4, hidden_size=16, intermediate_size=32,
                              num_hidden_layers=1, num_attention_heads=2, projection_dim=16)  # fmt: skip
    text = LlamaConfig(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)  # fmt: skip
    LlavaConfig(vision_config=vision, text_config=text, image_token_index=4, vision_feature_layer=-1,
                vision_feature_select_strategy="default", image_seq_length=(image_size // 4) ** 2).save_pretrained(folder)  # fmt: skip
    side = processor_size or image_size
    images = CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=4, vision_feature_select_strategy="default",
                   image_token="<image>", num_additional_image_tokens=1).save_pretrained(folder)  # fmt: skip
    return folder


def make_rows(root: Path, per_colour: int = 16, seed: int = 0, chat_every: int = 4) -> Path:
    """rows.jsonl of noisy PNGs whose caption is their colour's name; every `chat_every`-th row a chat instead."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, colour in COLOURS.items():
        for i in range(per_colour):
            pixels = np.array(colour)[None, None] + rng.normal(0, 30, (20, 20, 3))
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(root / f"{name}{i}.png")
            if i % chat_every == chat_every - 1:
                question = [{"type": "image"}, {"type": "text", "text": " colour?"}]
                rows.append({"image": f"{name}{i}.png", "messages": [{"role": "user", "content": question},
                                                                     {"role": "assistant", "content": name}]})  # fmt: skip
            else:
                rows.append({"image": f"{name}{i}.png", "caption": name})
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "rows.jsonl"


def prepare(tmp: Path, rows: Path, *extra: str) -> Path:
    out = tmp / "data"
    run_cli_in_process(["data", "prepare", str(rows), "--out", str(out), "--format", "image-text", "--val-share",
                        "0.2", *extra], tmp)  # fmt: skip
    return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, Path]:
    """(the model folder, the prepared data)."""
    tmp = tmp_path_factory.mktemp("vlm")
    return make_vlm(tmp / "model"), prepare(tmp, make_rows(tmp / "rows"))


def _resolve(overrides: list[str]):
    from scaletrain.config import load_config
    from scaletrain.resolve.job import resolve_job

    return resolve_job(load_config(None, overrides), 1)


def test_prepare_writes_image_and_text_members_and_refuses_a_row_without_image(prepared, tmp_path):
    import tarfile

    from scaletrain.data.images import IMAGE_TEXT, ImageShards

    _, data = prepared
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["format"] == "image-text" and manifest["splits"]["train"]["samples"] > 0
    with tarfile.open(data / manifest["splits"]["train"]["shards"][0]["tar"]) as tar:
        names = tar.getnames()
        record = json.loads(tar.extractfile(names[1]).read())  # type: ignore[union-attr]
    assert names[0].endswith(".png") and names[1] == names[0].replace(".png", ".json")  # WebDataset: KEY.png+KEY.json
    shards = ImageShards(data, "train", fmt=IMAGE_TEXT)
    assert shards.read_text(0) == record
    shards.close()
    (tmp_path / "bad.jsonl").write_text(json.dumps({"caption": "red"}) + "\n")
    bad = run_cli_in_process(["data", "prepare", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "x"), "--format",
                              "image-text"], tmp_path, check=False)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.strip() == (
        f"scaletrain: error: {tmp_path / 'bad.jsonl'}:1: no 'image' key (the image's path); give every row its "
        "image, or name the key with --image-key"
    )
    assert not (tmp_path / "x").exists()


def test_rows_train_the_answer_only_and_freeze_and_bad_image_size_refused(prepared, tmp_path):
    from scaletrain.config import load_config
    from scaletrain.data.image_text_loader import IGNORE_INDEX
    from scaletrain.tasks.registry import task_for

    model, data = prepared
    job = ["task.name=vision-language", f"model.hf={model}", f"data.path={data}", "data.seq_len=48",
           "train.global_batch_size=4"]  # fmt: skip
    overrides = [*job, 'model.freeze=["vision","projector"]']
    spec, cfg = _resolve(overrides).spec, load_config(None, overrides)
    task = task_for(cfg.task)
    assert spec.family == "vlm" and spec.architecture == "LlavaForConditionalGeneration"
    built = spec.build("meta")
    trained = {n.split(".")[1] for n, p in built.named_parameters() if p.requires_grad}
    assert trained == {"language_model", "weight"}  # lm_head.weight and the language model only
    train, val = task.loaders(cfg, spec, 4, 0, 1)
    try:
        batch = train.next_step()[0]
        assert batch.pixel_values.shape == (4, 3, 16, 16) and batch.input_ids.shape == (4, 48)
        image = batch.input_ids == spec.image_token_id
        assert image.sum(dim=1).tolist() == [16] * 4  # every row holds its image's 16 tokens
        trained_at = batch.targets != IGNORE_INDEX
        # no image token is ever a target: a trained position's next input token is never an image token
        assert not (trained_at[:, :-1] & image[:, 1:]).any() and not (batch.targets == spec.image_token_id).any()
        # the answer: the colour's name and the end token, the last prompt position predicting its first letter
        assert task.count(batch) == int(trained_at.sum()) and 4 * 4 <= task.count(batch) <= 4 * 6
    finally:
        train.close()
        val.close()
    small = make_vlm(tmp_path / "small", processor_size=24)
    with pytest.raises(ValueError) as e:
        _resolve([*job, f"model.hf={small}"])
    assert str(e.value) == (
        "model.hf: the processor makes 24x24 images, the vision tower takes 16x16 (vision_config.image_size); make "
        "the image processor's size / crop_size 16"
    )
    with pytest.raises(ValueError, match="^model.freeze: unknown part 'eyes'; choose among vision, projector"):
        _resolve([*job, 'model.freeze=["eyes"]'])
    with pytest.raises(ValueError, match="^parallel.tp: tensor parallelism of a vision-language model is not"):
        spec.check_tp(2)


def test_plan_of_the_job_traces_the_whole_model_with_its_images_and_ranks_what_train_runs(prepared, tmp_path):
    """`scaletrain plan CONFIG` for a vision-language job: the decoder formulas would leave the vision tower out, so
    the model is traced with one image's tokens and pixels per row (the tower's convolution and matmuls run); only
    the layouts the trainer runs for it are ranked (no TP, pipeline or context parallelism)."""
    from scaletrain.config import load_config
    from scaletrain.models.registry import model_spec
    from scaletrain.plan.trace import spec_target, trace_model

    model, data = prepared
    job = [*VLM_JOB, f"model.hf={model}", f"data.path={data}"]
    spec = model_spec(load_config(None, job).model)
    trace = trace_model(spec_target(spec, 48), "fp32")
    ops = {(op.layer, op.op) for op in trace.ops if op.phase == "forward"}  # the root: outside the LM's blocks
    assert ("root", "aten.convolution") in ops  # the vision tower's patch embedding saw the pixels
    assert sum(layer.params * layer.repeat for layer in trace.layers) == spec.num_params()
    out = run_cli_in_process(["plan", *job, "--gpu", "h100-sxm", "--gpus", "4", "--json"], tmp_path)
    plan = json.loads(out.stdout)
    assert plan["model"] == "LlavaForConditionalGeneration" and plan["params"] == spec.num_params()
    assert plan["rows"] and all(
        (r["layout"]["tp"], r["layout"]["pp"], r["layout"]["cp"]) == (1, 1, 1) for r in plan["rows"]
    )


VLM_JOB = ["task.name=vision-language", "data.seq_len=48", "train.global_batch_size=8", "train.lr=0.01",
           "train.eval_batches=1"]  # fmt: skip


@pytest.fixture(scope="module")
def layouts(prepared, tmp_path_factory):
    """One process (5 bare steps, and 40 steps of the trainer's own loop to a final checkpoint) and, in one 2-rank
    launch, DDP (with accumulation) and FSDP2 over 5 steps."""
    from test_parallel_layouts import launch_runner

    model, data = prepared
    out = tmp_path_factory.mktemp("vlm_layouts")
    base = [*VLM_JOB, f"model.hf={model}", f"data.path={data}"]
    five = [*base, "train.steps=5"]
    fit = [*base, "train.steps=40", "train.warmup_steps=2", "train.eval_interval=40", f"run.output_dir={out}",
           "run.name=fit", "monitor.log_interval=5", "checkpoint.save_final=true"]  # fmt: skip
    launch_runner(1, {"single": [*five, "parallel.dp_shard=1"], "fit": [*fit, "parallel.dp_shard=1"]}, out,
                  fit=frozenset({"fit"}))  # fmt: skip
    launch_runner(2, {"ddp2_accumulate": [*five, "parallel.dp_replicate=2", "train.micro_batch_size=2"],
                      "fsdp2": [*five, "parallel.dp_shard=2"]}, out)  # fmt: skip
    return out


@pytest.mark.slow  # two launches (one process, two ranks)
def test_ddp_and_fsdp_losses_equal_one_process(layouts):
    from test_parallel_layouts import runner_losses

    ref = runner_losses(layouts / "single")
    assert len(ref) == 5
    for name in ("ddp2_accumulate", "fsdp2"):
        got = runner_losses(layouts / name)
        for step, (a, b) in enumerate(zip(ref, got, strict=True), 1):
            assert abs(a - b) <= TOL, f"{name} step {step}: {b} vs one process {a}"


@pytest.mark.slow  # shares the launches above
def test_training_learns_the_captions_of_the_images(layouts):
    from scaletrain.monitor import read_jsonl

    records = read_jsonl(layouts / "fit/metrics.jsonl")
    losses = [r["loss"] for r in records if "loss" in r]
    accuracy = [r["val_token_accuracy"] for r in records if "val_token_accuracy" in r]
    assert losses[-1] < 0.3 * losses[0], losses
    assert accuracy and accuracy[-1] > 0.9, records[-3:]


@pytest.mark.slow  # shares the launches above
def test_export_hf_loads_in_transformers_with_equal_logits(layouts, prepared, tmp_path):
    """The checkpoint leaves the frozen weights out (the tower's unused post-layernorm here); the export makes them
    again from the run's seed, so the folder is the whole trained model."""
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from scaletrain.checkpoint.entries import saved_entries
    from scaletrain.checkpoint.export import load_full_model_state

    ckpt = layouts / "fit/checkpoints" / f"step_{40:08d}"
    assert not any("post_layernorm" in n for n in saved_entries(ckpt))  # frozen: not saved
    run_cli_in_process(["ckpt", "export", str(ckpt), "--format", "hf", "--out", str(tmp_path / "hf")], layouts)
    hf = LlavaForConditionalGeneration.from_pretrained(str(tmp_path / "hf")).eval()
    processor = AutoProcessor.from_pretrained(str(tmp_path / "hf"), backend="pil")  # the processor came along
    state, spec = load_full_model_state(ckpt)
    assert spec is not None
    ours = spec.build("cpu").eval()
    ours.load_state_dict(state)
    theirs_state = hf.state_dict()
    tower = "model.vision_tower.post_layernorm.weight"
    assert torch.equal(theirs_state[tower], state[tower])  # the frozen weight as the run's init made it
    from PIL import Image

    image = Image.fromarray(np.full((16, 16, 3), COLOURS["blue"], dtype=np.uint8))
    enc = processor(text="<image>", images=image, return_tensors="pt")
    with torch.no_grad():
        theirs = hf(input_ids=enc["input_ids"], pixel_values=enc["pixel_values"]).logits
        assert torch.equal(theirs, ours(enc["input_ids"], enc["pixel_values"]))
        answer = hf.generate(**enc, max_new_tokens=5, do_sample=False)[0, enc["input_ids"].shape[1] :]
    # greedy caption of a new image (one token per character: decode would put spaces between them)
    assert "".join(processor.tokenizer.convert_ids_to_tokens(answer, skip_special_tokens=True)) == "blue"
