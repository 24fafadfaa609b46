"""A small ResNet with BatchNorm, built here, trained with `scaletrain.setup()`: FSDP2 with bf16 compute.

    torchrun --nproc-per-node 2 examples/vision_bf16.py     # FSDP over 2 CPU ranks (or 2 GPUs), bf16
    python examples/vision_bf16.py                          # one process (bf16 autocast)

`shard=BasicBlock` names the FSDP units (one per residual block). Under bf16 each BatchNorm computes in fp32 (its
running statistics are fp32) and hands bf16 on. The task is synthetic: which quadrant of a noisy 16x16 image is
bright. Rank 0 prints `step N loss X accuracy Y` (means over data-parallel ranks).
"""

import torch
import torch.distributed as dist
from torch import nn

import scaletrain


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.skip = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.skip = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.skip(x))


class ResNet(nn.Module):
    def __init__(self, classes: int = 4, width: int = 16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.stages = nn.Sequential(
            BasicBlock(width, width, 1), BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 2 * width, 1)
        )
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x):
        return self.head(self.stages(self.stem(x)).mean((2, 3)))


class Quadrants(torch.utils.data.Dataset):
    def __init__(self, n: int):
        gen = torch.Generator().manual_seed(3)
        self.labels = torch.randint(0, 4, (n,), generator=gen)
        self.images = torch.randn(n, 3, 16, 16, generator=gen) * 0.5
        for i, label in enumerate(self.labels.tolist()):
            r, c = divmod(label, 2)
            self.images[i, :, r * 8 : r * 8 + 8, c * 8 : c * 8 + 8] += 1.0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i], self.labels[i]


def main() -> None:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = ResNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    job = scaletrain.setup(model, optimizer, data_parallel="fsdp", precision="bf16", shard=BasicBlock, grad_clip=1.0)
    if job.rank == 0:
        print(f"layout {job.layout.describe_mesh()}", flush=True)
    loader = job.loader(Quadrants(512), global_batch_size=32)
    for step, (images, labels) in zip(range(1, 21), loader):
        with job.autocast():
            logits = job.model(images.to(job.device))
        loss = nn.functional.cross_entropy(logits.float(), labels.to(job.device))
        job.backward(loss)
        job.step()
        if step % 5 == 0:
            stats = torch.stack([loss.detach(), (logits.argmax(-1) == labels.to(job.device)).float().mean()])
            dist.all_reduce(stats)
            if job.rank == 0:
                loss_mean, acc = (stats / job.world_size).tolist()
                print(f"step {step} loss {loss_mean:.4f} accuracy {acc:.3f}", flush=True)


if __name__ == "__main__":
    main()
