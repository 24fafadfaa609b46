"""GPU check of document packing (issue 28): on CUDA the built-in Llama attends per document with flex_attention
block masks; this compares its loss and gradients with SDPA's boolean mask (the CPU path) on the same packed rows,
and with the same documents padded one per row, then times packed vs padded training steps (trained tokens/s).

    python benchmarks/packing_gpu_check.py            # on a CUDA machine; a minute or two
    python benchmarks/packing_gpu_check.py --device cpu --steps 2    # the same code path on CPU, SDPA only

Prints one JSON object: max |loss| differences (flex vs sdpa, packed vs padded) and tokens/s of each layout.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from scaletrain.data.packing import PackedDocuments
from scaletrain.data.stream import TokenStream
from scaletrain.models.llama.args import LlamaArgs
from scaletrain.models.llama.model import Llama
from scaletrain.models.loss import token_loss_sum


def documents(n: int, seq: int, seed: int = 0) -> TokenStream:
    """n documents of 1/8 to 1/4 of a row each (short chat-like samples), ids below 32k."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(seq // 8, seq // 4, n)
    tokens = rng.integers(1, 32000, int(lengths.sum()))
    return TokenStream.of(tokens, np.cumsum(lengths)[:-1])


def batch(ds: PackedDocuments, rows: int, device: str) -> dict:
    r = ds.read(np.arange(rows))
    out = {"inputs": torch.from_numpy(r.inputs), "targets": torch.from_numpy(r.targets)}
    if r.positions is not None and r.documents is not None:
        out |= {"positions": torch.from_numpy(r.positions), "documents": torch.from_numpy(r.documents)}
    return {k: v.to(device) for k, v in out.items()}


def loss(model: Llama, b: dict) -> torch.Tensor:
    logits = model(b["inputs"], positions=b.get("positions"), documents=b.get("documents"))
    return token_loss_sum(logits, b["targets"]) / (b["targets"] != -100).sum()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    a = parser.parse_args()
    torch.manual_seed(0)
    args = LlamaArgs(dim=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=1536, vocab_size=32000, max_seq_len=a.seq)
    model = Llama(args).to(a.device)
    stream = documents(a.rows * 8, a.seq)
    packed = PackedDocuments(stream, a.seq, "document")
    padded = PackedDocuments(stream, a.seq, "pad")
    b_packed = batch(packed, a.rows, a.device)
    n_docs = int(packed.packs[a.rows])
    b_padded = batch(padded, n_docs, a.device)
    out: dict = {"device": a.device, "seq": a.seq, "rows": a.rows, "documents": n_docs}
    kernels = ["sdpa", "flex"] if a.device == "cuda" else ["sdpa"]
    losses = {}
    for kernel in kernels:
        os.environ["SCALETRAIN_DOCUMENT_ATTENTION"] = kernel
        losses[kernel] = loss(model, b_packed).item()
    out["loss"] = {**losses, "padded": loss(model, b_padded).item()}
    out["max_abs_diff_packed_vs_padded"] = max(abs(v - out["loss"]["padded"]) for v in losses.values())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for name, b in (("packed", b_packed), ("padded", b_padded)):
        os.environ["SCALETRAIN_DOCUMENT_ATTENTION"] = kernels[-1]
        for step in range(a.steps + 1):
            if step == 1:  # the first step compiles
                if a.device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
            opt.zero_grad()
            with torch.autocast(a.device, torch.bfloat16, enabled=a.device == "cuda"):
                value = loss(model, b)
            value.backward()
            opt.step()
        if a.device == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / max(a.steps, 1)
        out[f"{name}_trained_tokens_per_s"] = int((b["targets"] != -100).sum()) / seconds
    out["packed_over_padded"] = out["packed_trained_tokens_per_s"] / out["padded_trained_tokens_per_s"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
