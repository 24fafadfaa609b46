"""The loader of the vision-language task: image-text samples of a prepared folder (`--format image-text`,
data/images.py) turned into what a LLaVA-style model takes, by the model's own processor (transformers'
AutoProcessor from the model folder: its image processor makes the pixels, its tokenizer the ids, and it expands
the image placeholder into the model's image tokens).

A sample becomes one row of `seq_len` positions: the prompt (the image placeholder and task.prompt for a caption;
the chat template's rendering of every turn but the last for a messages list) followed by the answer (the caption
and the tokenizer's end-of-sequence token; the last, assistant, turn as the template renders it). Inputs are the
row's tokens, targets the next token where it is an answer token and IGNORE_INDEX elsewhere: the prompt and the
image tokens are never trained; a row is right-padded (pad id in, IGNORE_INDEX out; padding comes after every real
token, so causal attention never sees it), an answer too long for the row is cut. Order, sharding over ranks,
resume and prefetch are the image loader's (data/image_loader.py): the position is one integer, and a sample's
encoding is a pure function of its bytes.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from scaletrain.data.image_loader import ImageLoader
from scaletrain.data.images import ImageShards, Pixels

IGNORE_INDEX = -100  # torch's cross_entropy and Hugging Face labels' convention (models/loss.py)


@dataclass
class ImageTextBatch:
    input_ids: torch.Tensor  # (b, S) int64: prompt (with the image tokens) + answer, right-padded
    pixel_values: torch.Tensor  # (b, C, H, W) float32, from the model's image processor
    targets: torch.Tensor  # (b, S) int64: the next token on answer positions, IGNORE_INDEX elsewhere

    @property
    def trained_tokens(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())


class ImageTextEncoder:
    """One sample's (input ids, pixels, targets) from its image bytes and text record, through the model's processor
    (one per decoding thread: tokenizers are not shared across threads)."""

    def __init__(self, processor: Callable[[], Any], seq_len: int, image_token_id: int, prompt: str = ""):
        self._make, self.seq_len, self.image_token_id, self.prompt = processor, seq_len, image_token_id, prompt
        self._local = threading.local()

    def processor(self) -> Any:
        p = getattr(self._local, "processor", None)
        if p is None:
            p = self._local.processor = self._make()
        return p

    def render(self, record: dict) -> tuple[str, str]:
        """(prompt text, answer text) of a caption or a messages record."""
        processor = self.processor()
        if "caption" in record:
            image = getattr(processor, "image_token", "<image>")
            return f"{image}{self.prompt}", str(record["caption"]) + (processor.tokenizer.eos_token or "")
        messages = record["messages"]
        whole = processor.apply_chat_template(messages, tokenize=False)
        prompt = processor.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        if not whole.startswith(prompt):
            raise ValueError("the processor's chat template renders the last turn's prompt differently from the "
                             "whole conversation; the answer cannot be separated from it")  # fmt: skip
        return prompt, whole[len(prompt) :]

    def encode(self, data: bytes, record: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from PIL import Image

        processor = self.processor()
        with Image.open(io.BytesIO(data)) as encoded:
            image = encoded.convert("RGB")
        prompt, answer = self.render(record)
        enc = processor(text=prompt, images=image, return_tensors="pt")
        prompt_ids = enc["input_ids"][0].tolist()
        answer_ids = processor.tokenizer(answer, add_special_tokens=False)["input_ids"]
        if len(prompt_ids) >= self.seq_len:
            raise ValueError(f"data.seq_len: a sample's prompt is {len(prompt_ids)} tokens (its image's included), "
                             f"the row {self.seq_len}; raise data.seq_len")  # fmt: skip
        ids = (prompt_ids + answer_ids)[: self.seq_len + 1]
        inputs = torch.full((self.seq_len,), int(processor.tokenizer.pad_token_id or 0), dtype=torch.int64)
        targets = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.int64)
        inputs[: len(ids) - 1] = torch.tensor(ids[:-1])
        start = len(prompt_ids) - 1  # the target of the prompt's last position is the answer's first token
        targets[start : len(ids) - 1] = torch.tensor(ids[len(prompt_ids) :])
        targets[targets == self.image_token_id] = IGNORE_INDEX  # an image token is never a target
        return inputs, enc["pixel_values"][0].float(), targets


class ImageTextLoader(ImageLoader):
    """ImageLoader whose micro-batches are ImageTextBatch (ids, pixels and targets from the model's processor)."""

    trained_only = True  # the answer tokens only: the step's count is summed over the ranks

    def __init__(self, shards: ImageShards, encoder: ImageTextEncoder, *args: Any, **kwargs: Any):
        # the pixels come from the model's image processor (encoder), not from Pixels: it only names their size
        super().__init__(shards, Pixels(0, 3, augment=False), *args, **kwargs)
        self.encoder = encoder

    def _encode(self, position: int, sample: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        data, _ = self.shards.read(sample)
        return self.encoder.encode(data, self.shards.read_text(sample))

    def _step_at(self, position: int) -> list[ImageTextBatch]:  # type: ignore[override]
        per_rank = self.global_batch // self.dp_size
        start = position + self.dp_rank * per_rank
        samples = self.sample_ids(start, per_rank)
        encoded = list(self._decoders.map(self._encode, range(start, start + per_rank), samples))
        batches = []
        for m in range(0, per_rank, self.micro_batch):
            chunk = encoded[m : m + self.micro_batch]
            batches.append(ImageTextBatch(*(torch.stack([row[k] for row in chunk]) for k in range(3))))
        return batches

    def next_step(self) -> list[ImageTextBatch]:  # type: ignore[override]
        return super().next_step()  # type: ignore[return-value]
