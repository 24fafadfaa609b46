"""The job every hand-written runner in benchmarks/ trains, in one place so the runners cannot drift apart:
the same built-in model, init (seed 0), data windows (scaletrain.data), global batch and AdamW settings as
`scaletrain train` with its defaults (lr 3e-3, betas 0.9/0.95, weight decay 0.1, clip 1.0, foreach).

Each runner keeps its own loop, written the way that tool's documentation shows it.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from scaletrain.config import DataConfig, ModelConfig
from scaletrain.data import DistributedLoader, build_loaders
from scaletrain.models import model_spec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def job_args(description: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--max-bytes", type=int, default=1_000_000)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    ap.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
    ap.add_argument("--hf", action="store_true", help="train a transformers LlamaForCausalLM of the preset's shape")
    return ap.parse_args()


def hf_llama(a: argparse.Namespace):
    """A random transformers LlamaForCausalLM of the preset's shape (seed 0, untied, built from a config: nothing
    is downloaded); its forward returns an output whose .logits the runners read."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = model_spec(ModelConfig(name=a.model)).shape()
    assert shape is not None
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.dim,
        intermediate_size=shape.ffn_dim,
        num_hidden_layers=shape.n_layers,
        num_attention_heads=shape.n_heads,
        num_key_value_heads=shape.n_kv_heads,
        max_position_embeddings=shape.max_seq_len,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config), shape


def logits_of(model, inputs: torch.Tensor) -> torch.Tensor:
    out = model(inputs)
    return out if isinstance(out, torch.Tensor) else out.logits


def model_on(a: argparse.Namespace, device: torch.device | str):
    """(model with seed-0 weights on `device`, its decoder shape); with --hf the transformers Llama of that shape."""
    if getattr(a, "hf", False):
        model, shape = hf_llama(a)
        return model.to(device), shape
    spec = model_spec(ModelConfig(name=a.model))
    model = spec.build(device)
    spec.init_weights(model, seed=0)
    return model, spec.shape()


def loader_for(a: argparse.Namespace, rank: int, world: int) -> DistributedLoader:
    """This rank's share of each global batch, from the same token stream and order as scaletrain's."""
    cfg = DataConfig(seq_len=a.seq_len, max_bytes=a.max_bytes, prefetch=0)
    return build_loaders(cfg, 256, 0, a.global_batch, a.global_batch // world, rank, world)[0]


def adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)


class WindowClock:
    """Mean step time of each `log_every`-step window, measured by the runner itself (seconds)."""

    def __init__(self, log_every: int):
        self.log_every, self.windows, self._t0 = log_every, [], time.perf_counter()

    def lap(self) -> None:
        now = time.perf_counter()
        self.windows.append((now - self._t0) / self.log_every)
        self._t0 = now

    def report(self) -> None:
        print(json.dumps({"window_step_time_s": self.windows}), flush=True)


def leave_process_group() -> None:
    """Barrier, then destroy the process group. Without the barrier a gloo worker thread can still be releasing a
    finished collective's tensors (which needs the GIL) while the main thread destroys the group holding the GIL:
    the process hangs in ~ProcessGroupGloo (seen here, gdb) or aborts at exit. A torch issue, not the loop's; every
    runner gets the same workaround so teardown never decides a measurement."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()
