"""GPU check of QLoRA (issue 28): the built-in Llama with LoRA adapters on a 4-bit NF4 base (lora.quantize='nf4',
models/lora.py) on CUDA. The same model (same init by name, same adapters, same base quantized whole) computes its
loss and the adapters' gradients on CUDA and on the CPU (fp32 both, the CPU path the tests check); then LoRA on a
full-precision base and QLoRA train the same steps at bf16 autocast on the device, timed, with the peak memory each
takes (the fp32 base against the 4-bit one).

    python benchmarks/qlora_gpu_check.py                           # on a CUDA machine; a minute or two
    python benchmarks/qlora_gpu_check.py --device cpu --dim 256 --layers 2 --seq 128 --steps 2   # the same path on CPU

Prints one JSON object: the loss on each device and their difference, the largest adapter-gradient difference, and
per variant tokens/s, peak memory (CUDA: max_memory_allocated) and the base's bytes.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from scaletrain.config.schema import LoraConfig
from scaletrain.models.llama.args import LlamaArgs
from scaletrain.models.llama.spec import LlamaSpec
from scaletrain.models.lora import add_lora, fill_base, init_adapters
from scaletrain.models.loss import token_loss_sum


def build(spec: LlamaSpec, quantize: str, device: str) -> torch.nn.Module:
    """The adapted model as the trainer builds it on one rank: meta build, LoRA (and NF4), weights filled by name."""
    model = add_lora(spec.build("meta"), LoraConfig(rank=16, alpha=32, quantize=quantize), spec)
    model.to_empty(device=device)
    fill_base(model, lambda m: spec.init_weights(m, 0))
    init_adapters(model, 0)
    with torch.no_grad():  # lora_B starts at zero: give it values so the adapters' gradients all count
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.full_like(p, 1e-3))
    return model


def base_bytes(model: torch.nn.Module) -> int:
    total = 0
    for p in model.parameters():
        if type(p).__name__ == "NF4Tensor":
            total += sum(getattr(p, n).nbytes for n in p.__tensor_flatten__()[0])
        elif not p.requires_grad:
            total += p.numel() * p.element_size()
    return total


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return token_loss_sum(logits, tokens[:, 1:]) / tokens[:, 1:].numel()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    a = parser.parse_args()
    args = LlamaArgs(
        dim=a.dim, n_layers=a.layers, n_heads=a.dim // 128, n_kv_heads=max(1, a.dim // 512), ffn_dim=a.dim * 3,
        vocab_size=32000, max_seq_len=a.seq,
    )  # fmt: skip
    spec = LlamaSpec(args)
    tokens = torch.randint(0, args.vocab_size, (a.rows, a.seq + 1), generator=torch.Generator().manual_seed(0))
    out: dict = {"device": a.device, "dim": a.dim, "layers": a.layers, "seq": a.seq, "rows": a.rows}

    # parity: the same QLoRA model on the device and on the CPU, fp32
    grads, losses = {}, {}
    for device in dict.fromkeys([a.device, "cpu"]):
        model = build(spec, "nf4", device)
        value = loss_of(model, tokens.to(device))
        value.backward()
        losses[device] = value.item()
        grads[device] = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
        del model
    out["loss"] = losses
    out["loss_abs_diff"] = abs(losses[a.device] - losses["cpu"])
    out["adapter_grad_max_abs_diff"] = max(
        float((grads[a.device][n] - grads["cpu"][n]).abs().max()) for n in grads["cpu"]
    )

    # LoRA (fp32 base) against QLoRA (4-bit base): the same steps, bf16 autocast on CUDA
    for quantize in ("none", "nf4"):
        if a.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        model = build(spec, quantize, a.device)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        batch = tokens.to(a.device)
        start = time.perf_counter()
        for step in range(a.steps + 1):
            if step == 1:  # the first step warms up
                if a.device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
            opt.zero_grad()
            with torch.autocast(a.device, torch.bfloat16, enabled=a.device == "cuda"):
                value = loss_of(model, batch)
            value.backward()
            opt.step()
        if a.device == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / max(a.steps, 1)
        name = "qlora" if quantize == "nf4" else "lora"
        out[name] = {
            "tokens_per_s": a.rows * a.seq / seconds,
            "base_bytes": base_bytes(model),
            "peak_bytes": torch.cuda.max_memory_allocated() if a.device == "cuda" else None,
            "final_loss": value.item(),
        }
        del model, opt
    out["qlora_over_lora_tokens_per_s"] = out["qlora"]["tokens_per_s"] / out["lora"]["tokens_per_s"]
    out["qlora_over_lora_base_bytes"] = out["qlora"]["base_bytes"] / out["lora"]["base_bytes"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
