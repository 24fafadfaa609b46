"""recommendation: click prediction from dense and categorical features, the task of DLRM-style recommenders.

Batch: data.tabular_loader.TabularBatch from a folder `scaletrain data prepare --format tabular` wrote (data.path): (B, D)
float32 dense features, (B, T) int64 categorical ids (stable hashes: the model takes id % rows) and (B,) float32
labels (1: clicked). Loss: summed binary cross-entropy of the click logit, in fp32. Count: samples. Evaluation:
mean log loss, AUC (from 4,096-bin histograms of the predicted click probability of positives and negatives, summed
over every rank: exact but for pairs in one bin, counted half) and normalised entropy (the log loss over the
entropy of the validation clicks' base rate; below 1 means better than always predicting the base rate). The
model's tables and dense width come from the data (`bind_data`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from scaletrain.tasks.base import Task

if TYPE_CHECKING:
    import torch

    from scaletrain.config.schema import JobConfig
    from scaletrain.data.tabular_loader import TabularBatch
    from scaletrain.models.spec import ModelSpec

AUC_BINS = 4096


def binned_auc(positives: list[float], negatives: list[float]) -> float:
    """Area under the ROC curve from histograms of the predicted probability (equal-width bins, lowest first) of
    positive and negative samples: the share of (positive, negative) pairs the positive ranks above, a pair in
    one bin counted half. NaN when either class is empty."""
    pos, neg = sum(positives), sum(negatives)
    if not pos or not neg:
        return float("nan")
    below, pairs = 0.0, 0.0
    for p, n in zip(positives, negatives, strict=True):
        pairs += p * (below + 0.5 * n)
        below += n
    return pairs / (pos * neg)


class Recommendation(Task):
    name = "recommendation"
    unit = "samples"
    sequences = False  # (B, features): nothing for context parallelism to split

    def check(self, cfg: JobConfig, spec: ModelSpec) -> None:
        """The model has embedding tables to feed (a recommender); layouts and data this task reads."""
        if spec.embedding_tables() is None:
            raise ValueError(f"task.name: {self.name} feeds dense and categorical features, and the {spec.family} "
                             f"model is not a recommender; use model.name=dlrm-tiny (or another dlrm preset)")  # fmt: skip
        self.refuse_degrees(cfg, "tp", "pp", "cp", "ep")
        self.require_prepared(cfg, "tabular", "tabular")

    def check_data(self, cfg: JobConfig, spec: ModelSpec) -> None:
        """The folder is a prepared tabular dataset with training and validation samples."""
        from scaletrain.data.tabular import read_tabular_manifest

        assert cfg.data.path is not None  # check() refused a job without it
        manifest = read_tabular_manifest(Path(cfg.data.path))
        for split in ("train", "val"):
            if not manifest.splits.get(split, {}).get("samples"):
                raise ValueError(f"data.path: {cfg.data.path} has no {split} samples; prepare it again "
                                 f"(--val-share > 0 keeps some for validation)")  # fmt: skip
        if not manifest.sparse_cols:
            raise ValueError(f"data.path: {cfg.data.path} has no categorical columns for the model's tables; "
                             f"prepare it with --sparse-cols")  # fmt: skip

    def bind_data(self, cfg: JobConfig, spec: ModelSpec) -> ModelSpec:
        """The model's dense width and one table per categorical column, sized by the ids seen in training."""
        from scaletrain.data.tabular import read_tabular_manifest

        assert cfg.data.path is not None
        m = read_tabular_manifest(Path(cfg.data.path))
        with_data = getattr(spec, "with_data", None)
        distinct = [m.distinct_ids[c] for c in m.sparse_cols]
        return with_data(m.num_dense, list(m.sparse_cols), distinct) if with_data else spec

    def loaders(self, cfg: JobConfig, spec: ModelSpec, micro_batch: int, dp_rank: int, dp_size: int) -> tuple:
        from scaletrain.data.sources import cache_folder
        from scaletrain.data.tabular_loader import TabularLoader

        assert cfg.data.path is not None
        folder, gb, seed = Path(cfg.data.path), cfg.train.global_batch_size, cfg.run.seed
        cache = cache_folder(folder, cfg.data.cache_dir)
        return (
            TabularLoader(folder, "train", gb, micro_batch, dp_rank, dp_size, seed, prefetch=cfg.data.prefetch,
                          cache_dir=cache),
            TabularLoader(folder, "val", gb, micro_batch, dp_rank, dp_size, seed, shuffle=False, cache_dir=cache),
        )  # fmt: skip

    def inputs(self, batch: TabularBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return batch.dense, batch.sparse

    def targets(self, batch: TabularBatch) -> torch.Tensor:
        return batch.labels

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed binary cross-entropy of click logits (B,) against labels (B,) in {0, 1}, in fp32."""
        import torch.nn.functional as F

        return F.binary_cross_entropy_with_logits(outputs.float(), targets.float(), reduction="sum")

    def count(self, batch: TabularBatch) -> int:
        return int(batch.labels.numel())

    def flops_per_unit(self, cfg: JobConfig, spec: ModelSpec) -> float | None:
        per_sample = getattr(spec, "flops_per_sample", None)
        return per_sample() if callable(per_sample) else None

    def eval_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Histograms of the predicted click probability of positive and negative samples, and the positives."""
        import torch

        probability = torch.sigmoid(outputs.detach().float())
        bins = (probability * AUC_BINS).long().clamp_(0, AUC_BINS - 1)
        positive = targets > 0.5
        hist = torch.zeros((2, AUC_BINS), dtype=torch.float32, device=outputs.device)
        hist[0].index_add_(0, bins[positive], torch.ones_like(probability[positive]))
        hist[1].index_add_(0, bins[~positive], torch.ones_like(probability[~positive]))
        return {"auc_hist": hist.flatten(), "positives": positive.sum()}

    def eval_metrics(self, loss_sum: float, count: float, sums: dict[str, Any] | None = None) -> dict[str, Any]:
        import math

        metrics = {"val_loss": loss_sum / count}
        if sums is not None:
            hist = sums["auc_hist"]
            metrics["val_auc"] = binned_auc(hist[:AUC_BINS], hist[AUC_BINS:])
            rate = sums["positives"] / count
            if 0 < rate < 1:
                entropy = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
                metrics["val_ne"] = metrics["val_loss"] / entropy
        return metrics


TASK = Recommendation
