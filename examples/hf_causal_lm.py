"""A Hugging Face causal LM in your own loop with `scaletrain.setup()`: FSDP2 per decoder layer, tensor parallelism
from the model's own plan (transformers' base_model_tp_plan) or one you write, checkpoints that resume on another
number of ranks.

    python examples/hf_causal_lm.py                                          # one process
    torchrun --nproc-per-node 2 examples/hf_causal_lm.py --tp 2 --ckpt ckpt --stop-at 5
    torchrun --nproc-per-node 4 examples/hf_causal_lm.py --tp 2 --ckpt ckpt  # resumes at step 6: FSDP 2 x TP 2
    torchrun --nproc-per-node 2 examples/hf_causal_lm.py --tp 2 --tp-plan mine   # TP_PLAN below instead

The model is a tiny random LlamaForCausalLM built from a config (nothing is downloaded); the data is a map-style
dataset of token sequences with a learnable pattern. Rank 0 prints `step N loss X` (the mean over data-parallel
ranks); a resumed run prints the same numbers an uninterrupted one would.
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers import LlamaConfig, LlamaForCausalLM

import scaletrain

# A plan of your own (--tp-plan mine; without it setup() uses the model's own). Megatron-style: projections reading
# the hidden state split by output column, those writing it back by input row. Keys are module paths; `*` matches any
# one name (every decoder layer).
TP_PLAN = {
    "model.layers.*.self_attn.q_proj": ColwiseParallel(),
    "model.layers.*.self_attn.k_proj": ColwiseParallel(),
    "model.layers.*.self_attn.v_proj": ColwiseParallel(),
    "model.layers.*.self_attn.o_proj": RowwiseParallel(),
    "model.layers.*.mlp.gate_proj": ColwiseParallel(),
    "model.layers.*.mlp.up_proj": ColwiseParallel(),
    "model.layers.*.mlp.down_proj": RowwiseParallel(),
}


class PatternTokens(torch.utils.data.Dataset):
    """Sequences counting up by a per-sample stride modulo the vocabulary: learnable from the first tokens."""

    def __init__(self, n: int, seq_len: int, vocab: int):
        gen = torch.Generator().manual_seed(7)
        starts = torch.randint(0, vocab, (n, 1), generator=gen)
        strides = torch.randint(1, 4, (n, 1), generator=gen)
        self.rows = (starts + strides * torch.arange(seq_len)) % vocab

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.rows[i]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (divides the number of ranks)")
    ap.add_argument(
        "--tp-plan", default="model", choices=["model", "mine"], help="model: transformers' own; mine: TP_PLAN"
    )
    ap.add_argument("--data-parallel", default="fsdp", choices=["auto", "ddp", "fsdp"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--stop-at", type=int, default=0, help="save and stop after this step (an interruption)")
    ap.add_argument("--ckpt", default="", help="checkpoint folder: resume from it, save into it")
    ap.add_argument("--global-batch", type=int, default=8)
    args = ap.parse_args()

    torch.manual_seed(0)  # the same initial weights on every rank
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    plan = TP_PLAN if args.tp_plan == "mine" else None  # None: the model's own base_model_tp_plan
    job = scaletrain.setup(model, optimizer, data_parallel=args.data_parallel, tp=args.tp, tp_plan=plan, grad_clip=1.0)
    if job.rank == 0:
        print(f"layout {job.layout.describe_mesh()}", flush=True)
    loader = job.loader(PatternTokens(256, 16, config.vocab_size), global_batch_size=args.global_batch)
    if args.ckpt:
        extra = job.load(args.ckpt)  # None: nothing saved yet
        if extra is not None:
            loader.load_state_dict(extra["data"])
            if job.rank == 0:
                print(f"resumed at step {job.step_count} on {job.world_size} ranks", flush=True)

    batches = iter(loader)
    while job.step_count < args.steps:
        tokens = next(batches).to(job.device)
        with job.autocast():
            loss = job.model(input_ids=tokens, labels=tokens).loss
        job.backward(loss)
        job.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # tensor-parallel ranks hold the same loss: the world mean is the data-parallel one
        if job.rank == 0:
            print(f"step {job.step_count} loss {mean.item() / job.world_size:.6f}", flush=True)
        if args.ckpt and job.step_count == args.stop_at:
            job.save(args.ckpt, extra={"data": loader.state_dict()})
            return


if __name__ == "__main__":
    main()
