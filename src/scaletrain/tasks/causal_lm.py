"""causal-lm: next-token prediction on a token stream, the task of pre-training and continued pre-training.

Batch: data.Batch, (B, S) int64 inputs and the same tokens shifted by one as targets (IGNORE_INDEX where the loss
skips a target, e.g. a document's first token under data.mask_doc_starts); packed rows (data.packing="document")
also carry each token's position in its document and its document id, given to the model by keyword. Loss: summed
token cross-entropy with logits in fp32 (models/loss.py). Count: for a plain token stream every target position,
B·S per batch (masked ones included, so a step's normaliser is fixed by the config and needs no collective); where
the data decides what is trained (a loss mask of chat data, or rows of whole documents under data.packing = pad or
document, whose padding is never trained) the trained targets only, summed over the ranks (one all-reduce per
step), so the loss is the mean over trained tokens under accumulation and every layout. Evaluation: mean loss of the
validation split per counted token.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING

from scaletrain.tasks.base import Task

if TYPE_CHECKING:
    import torch

    from scaletrain.config.schema import JobConfig
    from scaletrain.data import Batch
    from scaletrain.models.spec import ModelSpec


def _reads_stdlib(cfg: JobConfig) -> bool:
    return cfg.data.source == "stdlib" or (cfg.data.source == "auto" and not cfg.data.path and not cfg.data.mix)


class CausalLM(Task):
    name = "causal-lm"
    unit = "tokens"

    def _vocab(self, spec: ModelSpec) -> int:
        vocab = spec.vocab_size
        if vocab is None:
            raise ValueError(
                f"task.name: {self.name} feeds token ids, and the {spec.family} model takes none; "
                f"pick the task this model is trained for"
            )
        return vocab

    def check(self, cfg: JobConfig, spec: ModelSpec) -> None:
        """The model embeds the data's token ids and takes sequences of data.seq_len."""
        vocab = self._vocab(spec)
        if _reads_stdlib(cfg) and vocab < 256:
            raise ValueError(f"model.vocab_size: byte-level stdlib text needs >= 256 tokens, the model has {vocab}")
        if spec.max_seq_len is not None and cfg.data.seq_len > spec.max_seq_len:
            raise ValueError(
                f"data.seq_len: {cfg.data.seq_len} exceeds the model's max_seq_len {spec.max_seq_len}; "
                f"lower data.seq_len or raise model.max_seq_len"
            )
        if cfg.data.packing == "document":
            if not spec.packs_documents:
                raise ValueError(
                    f"data.packing: the {spec.family} model cannot attend per document; use data.packing=pad"
                )
            if cfg.parallel.cp > 1 and cfg.parallel.cp_method != "allgather":
                raise ValueError(
                    "data.packing: document packing under context parallelism attends per document with the "
                    "allgather method only; set parallel.cp_method=allgather"
                )

    def check_data(self, cfg: JobConfig, spec: ModelSpec) -> None:
        """Every dataset opens, holds only ids the model can embed, passes its size (and checksum) checks and has
        at least one global batch and a validation sample (data/checks.py)."""
        from scaletrain.data.checks import check_data

        if _reads_stdlib(cfg):
            stdlib = Path(sysconfig.get_paths()["stdlib"])
            if not stdlib.is_dir():
                raise ValueError(
                    f"data.source: this Python's stdlib folder {stdlib} is missing; use data.source=synthetic"
                )
        check_data(cfg.data, self._vocab(spec), cfg.train.global_batch_size, cfg.run.seed)

    def loaders(self, cfg: JobConfig, spec: ModelSpec, micro_batch: int, dp_rank: int, dp_size: int) -> tuple:
        from scaletrain.data import build_loaders

        gb = cfg.train.global_batch_size
        loaders = build_loaders(cfg.data, self._vocab(spec), cfg.run.seed, gb, micro_batch, dp_rank, dp_size)
        # the same answer on every rank (every rank opens the same datasets): the step's count then needs a sum;
        # a subclass counting by content itself keeps its own True
        self.counts_vary = type(self).counts_vary or loaders[0].trained_only
        return loaders

    def inputs(self, batch: Batch) -> torch.Tensor:
        return batch.inputs

    def forward_kwargs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Packed rows' positions and document ids (the model attends within each document); none otherwise."""
        if batch.positions is None or batch.documents is None:
            return {}
        return {"positions": batch.positions, "documents": batch.documents}

    def targets(self, batch: Batch) -> torch.Tensor:
        return batch.targets

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of logits (B, S, V) against targets (B, S); IGNORE_INDEX targets add nothing."""
        from scaletrain.models.loss import token_loss_sum

        return token_loss_sum(outputs, targets)

    def count(self, batch: Batch) -> int:
        """Trained targets where the data decides them (a loss mask, padded rows), else every target position."""
        return batch.trained_tokens if batch.trained_only else batch.targets.numel()

    def flops_per_unit(self, cfg: JobConfig, spec: ModelSpec) -> float | None:
        try:
            return spec.flops_per_token(cfg.data.seq_len)
        except NotImplementedError:  # a family without a decoder shape that does not count its FLOPs
            return None


TASK = CausalLM
