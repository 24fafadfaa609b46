"""vision-language: captioning and visual instruction tuning of LLaVA-style models (a vision tower, a projector and
a causal language model; the vlm model family, `model.hf = FOLDER`).

Batch: data.image_text_loader.ImageTextBatch from a folder `scaletrain data prepare --format image-text` wrote
(data.path): each sample's image and text made into pixels and a row of data.seq_len token ids by the model's own
processor (AutoProcessor from the model folder), the prompt with its image tokens untrained and the answer (the
caption, or the last assistant turn of a chat) trained. The model takes (input_ids, pixel_values). Loss: summed
token cross-entropy of the logits in fp32 over the answer tokens (models/loss.py). Count: the trained tokens,
summed over the ranks each step, so the step's loss is the mean over answer tokens at any layout and accumulation
(transformers' own LLaVA loss with labels, per step). Evaluation: mean loss per answer token and token accuracy
(the share of answer tokens the greedy prediction gets right) over the validation split.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field

from scaletrain.tasks.base import Task

if TYPE_CHECKING:
    import torch

    from scaletrain.config.schema import JobConfig
    from scaletrain.data.image_text_loader import ImageTextBatch
    from scaletrain.models.spec import ModelSpec


@dataclass(frozen=True)
class Options:
    prompt: str = ""  # caption rows: the text after the image placeholder (e.g. "describe:"); chats bring their own
    decode_workers: Annotated[int, Field(gt=0, le=64)] = 2  # threads decoding and tokenizing a rank's samples


class VisionLanguage(Task):
    name = "vision-language"
    options_type = Options
    unit = "tokens"
    counts_vary = True  # the answer tokens: their count depends on the captions
    sequences = False  # the image tokens sit at the row's start: context parallelism would split them

    options: Options

    def check(self, cfg: JobConfig, spec: ModelSpec) -> None:
        """The model is a vision-language model whose processor matches its vision tower; layouts and data."""
        vlm: Any = spec
        if not callable(getattr(spec, "check_processor", None)):
            raise ValueError(f"task.name: {self.name} feeds images and text, and the {spec.family} model is not a "
                             f"vision-language model; use model.hf = a LLaVA-style folder")  # fmt: skip
        vlm.check_processor(vlm.processor())
        if spec.max_seq_len is not None and cfg.data.seq_len > spec.max_seq_len:
            raise ValueError(f"data.seq_len: {cfg.data.seq_len} exceeds the language model's max_position_embeddings "
                             f"{spec.max_seq_len}; lower data.seq_len")  # fmt: skip
        self.refuse_degrees(cfg, "pp", "cp")
        if cfg.parallel.tp > 1 and cfg.parallel.sequence_parallel:
            raise ValueError(f"parallel.sequence_parallel: {self.name} does not split its rows over tensor-parallel "
                             f"ranks yet; set parallel.sequence_parallel=false")  # fmt: skip
        if cfg.parallel.tp > 1 and cfg.parallel.loss_parallel:
            raise ValueError(f"parallel.loss_parallel: {self.name} computes its loss on whole logits; set "
                             f"parallel.loss_parallel=false")  # fmt: skip
        self.require_prepared(cfg, "image-text", "image-text")

    def check_data(self, cfg: JobConfig, spec: ModelSpec) -> None:
        """The folder is a prepared image-text dataset with training and validation samples."""
        from scaletrain.data.images import IMAGE_TEXT, read_manifest

        assert cfg.data.path is not None  # check() refused a job without it
        manifest = read_manifest(cfg.data.path, fmt=IMAGE_TEXT)
        for split in ("train", "val"):
            if not manifest.splits.get(split, {}).get("samples"):
                raise ValueError(f"data.path: {cfg.data.path} has no {split} samples; prepare it again "
                                 f"(--val-share > 0 keeps some for validation)")  # fmt: skip

    def loaders(self, cfg: JobConfig, spec: ModelSpec, micro_batch: int, dp_rank: int, dp_size: int) -> tuple:
        from scaletrain.data.image_text_loader import ImageTextEncoder, ImageTextLoader
        from scaletrain.data.images import IMAGE_TEXT, ImageShards
        from scaletrain.data.sources import cache_folder

        assert cfg.data.path is not None
        vlm: Any = spec  # the vlm family's spec (check() refused any other)
        encoder = ImageTextEncoder(vlm.processor, cfg.data.seq_len, vlm.image_token_id, self.options.prompt)
        gb, seed, workers = cfg.train.global_batch_size, cfg.run.seed, self.options.decode_workers
        train = ImageShards(cfg.data.path, "train", cache_folder(Path(cfg.data.path), cfg.data.cache_dir), IMAGE_TEXT)
        val = ImageShards(cfg.data.path, "val", fmt=IMAGE_TEXT)
        return (
            ImageTextLoader(train, encoder, gb, micro_batch, dp_rank, dp_size, seed, workers=workers,
                            prefetch=cfg.data.prefetch),
            ImageTextLoader(val, encoder, gb, micro_batch, dp_rank, dp_size, seed, shuffle=False, workers=workers),
        )  # fmt: skip

    def inputs(self, batch: ImageTextBatch) -> tuple[torch.Tensor, ...]:
        """(input_ids, pixel_values): the first two positional arguments of LlavaForConditionalGeneration."""
        return batch.input_ids, batch.pixel_values

    def targets(self, batch: ImageTextBatch) -> torch.Tensor:
        return batch.targets

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of logits (B, S, V) against targets (B, S); untrained positions add nothing."""
        from scaletrain.models.loss import token_loss_sum

        return token_loss_sum(outputs, targets)

    def count(self, batch: ImageTextBatch) -> int:
        return batch.trained_tokens

    def eval_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Answer tokens whose greedy prediction is right, summed."""
        from scaletrain.models.loss import IGNORE_INDEX

        return {"correct": ((outputs.argmax(dim=-1) == targets) & (targets != IGNORE_INDEX)).sum()}

    def eval_metrics(self, loss_sum: float, count: float, sums: dict[str, float] | None = None) -> dict[str, Any]:
        metrics = {"val_loss": loss_sum / count}
        if sums is not None:
            metrics["val_token_accuracy"] = sums["correct"] / count
        return metrics


TASK = VisionLanguage
