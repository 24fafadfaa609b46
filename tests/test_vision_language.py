"""The vision-language task through the same path as language models: `data prepare --format image-text` (the
image shards with the row's caption or chat beside each image), a LLaVA-style model (transformers'
LlavaForConditionalGeneration: a tiny CLIP vision tower and a tiny Llama, built from config objects here, with a
word-level tokenizer and a PIL image processor saved as its AutoProcessor) through `model.hf`, the loss on answer
tokens only, freeze policies, DDP 2 and FSDP 2 (and TP 2 on the language model) per-step losses equal to one
process, learning captions that are a function of the image, and the `ckpt export --format hf` folder loading in
transformers with equal logits. Images are generated here; nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli_in_process

COLOURS = {"red": (220, 20, 20), "green": (20, 220, 20), "blue": (20, 20, 220)}  # the caption names the colour
TOL = 1e-5
VOCAB = ["<pad>", "<s>", "</s>", "<unk>", "<image>", *"abcdefghijklmnopqrstuvwxyz:. ?"]


def make_vlm(folder: Path, image_size: int = 16, processor_size: int | None = None) -> Path:
    """A LLaVA folder: config.json (CLIP 16 px, patch 4 -> 16 image tokens; Llama 2 layers) and its processor."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        CLIPImageProcessor,
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
    images = CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
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
