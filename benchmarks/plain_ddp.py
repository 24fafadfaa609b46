"""The baseline a user would hand-write: torch DDP, AdamW, clipping, a loss print every `log_every` steps.

Same model definition, init, data windows and global batch as `scaletrain train` with parallel.dp_replicate=N.
Run under torchrun; rank 0 prints one JSON line with the mean step time of each logging window.
    torchrun --nproc-per-node 2 benchmarks/plain_ddp.py --steps 60 --log-every 10
"""

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from scaletrain.config import DataConfig, ModelConfig
from scaletrain.data import DistributedLoader, TokenWindows, load_tokens, split_stream
from scaletrain.models import build_model, init_weights, model_args


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--max-bytes", type=int, default=1_000_000)
    a = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    args = model_args(ModelConfig(name=a.model))
    model = build_model(args, "cpu")
    init_weights(model, args, seed=0)
    model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    tokens, _ = split_stream(load_tokens(DataConfig(seq_len=a.seq_len, max_bytes=a.max_bytes), 256, 0), 0.05)
    loader = DistributedLoader(TokenWindows(tokens, a.seq_len), a.global_batch, a.global_batch // world, rank,
                               world, seed=0)
    windows, t0 = [], time.perf_counter()
    for step in range(1, a.steps + 1):
        (batch,) = loader.next_step()
        logits = model(batch.inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % a.log_every == 0:
            dist.all_reduce(loss.detach())
            now = time.perf_counter()
            windows.append((now - t0) / a.log_every)
            t0 = now
    if rank == 0:
        print(json.dumps({"window_step_time_s": windows}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
