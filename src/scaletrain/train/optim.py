"""AdamW with decoupled weight decay on matrices only (foreach or fused kernels: train.optimizer_impl), and the warmup +
decay learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from scaletrain.config.schema import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over the trainable weights; weight decay on 2-D+ weights, none on norms (GPT-2 / Llama convention)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    # plain tensors and DTensors in groups of their own: the foreach kernels refuse to mix them, which a model does
    # whose embedding tables are sharded over the ranks beside DDP's plain weights (parallel/embedding.py)
    groups = [
        {"params": [p for p in params if isinstance(p, DTensor) == distributed], "weight_decay": wd}
        for params, wd in ((decay, cfg.weight_decay), (no_decay, 0.0))
        for distributed in (False, True)
    ]
    # only trainable weights (a LoRA base is frozen: no optimizer state); an empty group (LoRA's adapters are all
    # matrices) is left out: DCP's flattened optimizer state cannot load a group without parameters
    groups = [g for g in groups if g["params"]]
    kernels = {"fused": True} if cfg.optimizer_impl == "fused" and not _on_meta(groups) else {"foreach": True}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kernels)


def _on_meta(groups: list[dict]) -> bool:
    """A model laid out on the meta device (the planner's layout trace, train/layout_peak.py), where no fused kernel
    runs: foreach's list ops stand for it."""
    return any(p.device.type == "meta" for g in groups for p in g["params"])


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the peak lr before optimizer step `step` (0-based): linear warmup, then cosine/linear decay
    to min_lr_ratio at the last step, or constant."""
    warmup = min(cfg.warmup_steps, cfg.steps)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, cfg.steps - warmup - 1)
    progress = min(1.0, (step - warmup) / span)
    if cfg.schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
