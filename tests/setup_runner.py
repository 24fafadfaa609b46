"""Test helper (not a test): `scaletrain.setup(data_parallel="fsdp")` on models a new user brings, in one launch:

    torchrun --nproc-per-node 2 tests/setup_runner.py OUT_DIR

Each case trains a few steps with setup() and, on every rank, the same model in plain torch on the whole global
batch (no process group); rank 0 writes OUT_DIR/results.json with both loss lists and the FSDP unit count per case.
The Hugging Face case also saves with job.save(OUT_DIR/ckpt) and writes its full weights to OUT_DIR/hf_state.pt.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import scaletrain
from scaletrain.models.registry import preset_spec
from scaletrain.parallel import full_state_dict

STEPS = 3


def hf_llama(tied: bool) -> nn.Module:
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(cfg)


SPEC = preset_spec("tiny")


def builtin_llama() -> nn.Module:
    """scaletrain's own Llama (preset tiny): its spec gives setup() the TP plan and the blocks."""
    model = SPEC.build("meta")
    model.to_empty(device="cpu")
    SPEC.init_weights(model, seed=0)
    return model


class TiedSequential(nn.Module):
    """Tied embeddings and no ModuleList: FSDP units fall back to the root's children, which share a weight."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(self.body(self.embed(x)))


class Attention(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(nn.functional.scaled_dot_product_attention(q, k, v))


class ViT(nn.Module):
    """lucidrains vit-pytorch's layout: each layer is a bare nn.ModuleList([attention, feed-forward])."""

    def __init__(self, dim: int = 16, depth: int = 3):
        super().__init__()
        self.patch = nn.Linear(12, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleList([Attention(dim), nn.Sequential(nn.Linear(dim, 32), nn.GELU(), nn.Linear(32, dim))])
            for _ in range(depth)
        )
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        x = self.patch(x)
        for attn, ff in self.blocks:  # type: ignore[misc]
            x = x + attn(x)
            x = x + ff(x)
        return self.head(x.mean(1))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def lm_loss(model, x):
    out = model(x)
    logits = out.logits if hasattr(out, "logits") else out
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten())


def cls_loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x).float(), y)


def run_case(name, build, make_batch, loss_fn, out: Path, **setup_kw):
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    job = scaletrain.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), data_parallel="fsdp", **setup_kw)
    rank, world = job.dp_rank, job.dp_size
    units = sum(isinstance(m, FSDPModule) for m in job.model.modules())
    gen = torch.Generator().manual_seed(1)
    losses, ref_losses = [], []
    for _ in range(STEPS):
        batch = make_batch(gen)  # the global batch; this rank trains on its half
        mine = tuple(t.chunk(world)[rank] for t in batch) if isinstance(batch, tuple) else batch.chunk(world)[rank]
        with job.autocast():
            loss = loss_fn(job.model, mine)
        job.backward(loss)
        job.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)  # tensor-parallel ranks hold the same loss
        losses.append(mean.item() / job.world_size)
        ref_loss = loss_fn(ref, batch)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    if name == "hf_llama":
        saved = job.save(out / "ckpt", extra={"note": "hf", "losses": losses})
        state = full_state_dict(job.model)
        if rank == 0:
            torch.save(state, out / "hf_state.pt")
            (out / "saved_at.txt").write_text(str(saved))
    dist.barrier()
    dtensors = sum(hasattr(p, "device_mesh") for p in job.model.parameters())
    return {"losses": losses, "ref": ref_losses, "units": units, "dtensors": dtensors}


def main() -> None:
    out = Path(sys.argv[1])
    tokens = lambda g: torch.randint(0, 96, (4, 12), generator=g)  # noqa: E731
    results = {
        "hf_llama": run_case("hf_llama", lambda: hf_llama(False), tokens, lm_loss, out),
        "hf_llama_tied_named": run_case(
            "hf_llama_tied_named", lambda: hf_llama(True), tokens, lm_loss, out, shard=[LlamaDecoderLayer, nn.Embedding]
        ),
        "hf_llama_predicate": run_case(
            "hf_llama_predicate",
            lambda: hf_llama(False),
            tokens,
            lm_loss,
            out,
            shard=lambda name, m: name.endswith(".mlp"),
        ),
        "tied_sequential": run_case(
            "tied_sequential", TiedSequential, lambda g: torch.randint(0, 50, (4, 10), generator=g), lm_loss, out
        ),
        "vit": run_case(
            "vit",
            ViT,
            lambda g: (torch.randn(4, 6, 12, generator=g), torch.randint(0, 4, (4,), generator=g)),
            cls_loss,
            out,
        ),
        "cnn_bf16": run_case(
            "cnn_bf16",
            cnn,
            lambda g: (torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)),
            cls_loss,
            out,
            precision="bf16",
        ),
    }
    results["builtin_llama_tp"] = run_case("builtin_llama_tp", builtin_llama, tokens, lm_loss, out, tp=2, spec=SPEC)
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
