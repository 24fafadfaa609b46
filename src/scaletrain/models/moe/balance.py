"""Expert load after each optimizer step: tokens each expert was routed, summed over every rank, the imbalance
ratio (busiest expert over the mean) and dropped tokens; and the auxiliary-loss-free bias update of DeepSeek-V3
(arXiv 2412.19437 §2.1.2: b_e += rate · sign(mean load − load_e)), the same on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.models.moe.model import MoEFeedForward


def moe_layers(modules: list[nn.Module]) -> list[MoEFeedForward]:
    return [m for part in modules for m in part.modules() if isinstance(m, MoEFeedForward)]


@torch.no_grad()
def balance_experts(modules: list[nn.Module], n_layers: int, n_experts: int) -> dict[str, float]:
    """Read and clear the load counted since the last call in this rank's MoE layers (of `modules`: the model or
    its pipeline stages), sum it over all ranks (one all-reduce of n_layers x (n_experts + 2) numbers: every rank
    calls this, whatever it holds), move the selection biases and return the step's load metrics ({} when no
    token was routed: after a restore, or an optimizer step without a forward).

    Every token is counted once: TP ranks route different pieces of the sequences (models/moe/parallelize.py)."""
    layers = moe_layers(modules)
    device = layers[0].tokens_per_expert.device if layers else torch.device("cpu")
    load = torch.zeros(n_layers, n_experts + 2, dtype=torch.float64, device=device)
    for layer in layers:
        load[layer.layer_id, :n_experts] = layer.tokens_per_expert.double()
        load[layer.layer_id, n_experts] = layer.dropped_tokens.double()
        layer.tokens_per_expert.zero_()
        layer.dropped_tokens.zero_()
        # bytes an expert-parallel dispatcher sent to other ranks since the last call (parallel/expert.py)
        load[layer.layer_id, n_experts + 1] = float(getattr(layer.dispatcher, "take_bytes_sent", lambda: 0)())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(load)
    per_expert = load[:, :n_experts]
    for layer in layers:
        row = per_expert[layer.layer_id]
        rate = layer.args.bias_update_rate
        if rate > 0 and row.sum() > 0:
            layer.expert_bias += rate * torch.sign(row.mean() - row).to(layer.expert_bias.dtype)
    return load_metrics(load)


def load_metrics(load: torch.Tensor) -> dict[str, float]:
    """The step's expert-load metrics from `load` (n_layers x (n_experts + 2), summed over every rank: (token,
    expert) pairs per expert, then dropped pairs and all-to-all bytes sent per layer); {} when nothing was routed.
    Shared by every family with experts (transformers' too: models/hf/experts.py)."""
    n_experts = load.shape[1] - 2
    per_expert, dropped, sent = load[:, :n_experts], load[:, n_experts], load[:, n_experts + 1]
    routed = per_expert.sum(1)
    active = routed > 0
    if not bool(active.any()):
        return {}
    share = per_expert[active] / per_expert[active].mean(1, keepdim=True)  # load / mean load per MoE layer
    busiest = int(share.max(1).values.argmax())
    layer_ids = active.nonzero().flatten().tolist()
    return {
        "moe_imbalance": float(share.max()),  # the busiest expert of the worst layer, x its fair share
        "moe_imbalance_mean": float(share.max(1).values.mean()),
        "moe_busiest_layer": float(layer_ids[busiest]),
        "moe_busiest_expert": float(share[busiest].argmax()),
        "moe_dropped_frac": float(dropped[active].sum() / routed[active].sum()),
        "moe_routed": float(routed.sum()),  # (token, expert) pairs the routers chose, every layer and rank
        "moe_dropped": float(dropped.sum()),  # of which over an expert's capacity (model.capacity_factor)
        # hidden states the all-to-alls of expert parallelism sent between ranks, dispatch + combine, in every
        # forward since the last step (evaluation too; backward sends as many again), summed over ranks
        "moe_a2a_bytes": float(sent.sum()),
        "moe_min_load": float(share.min()),
    }


def tokens_per_expert(modules: list[nn.Module]) -> dict[int, list[float]]:
    """{layer: tokens routed to each expert since the last balance_experts} on this rank, for tests and reports."""
    return {m.layer_id: m.tokens_per_expert.tolist() for m in moe_layers(modules)}
