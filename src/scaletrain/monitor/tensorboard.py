"""TensorBoard sink: the metric records as scalars in event files, through torch.utils.tensorboard (which needs the
`tensorboard` package). Rank 0 only, like the JSONL sink."""

from __future__ import annotations

from pathlib import Path

# record key -> TensorBoard tag
TAGS = {
    "loss": "loss/train",
    "val_loss": "loss/val",
    "grad_norm": "optim/grad_norm",
    "lr": "optim/lr",
    "loss_scale": "optim/loss_scale",
    "tokens_per_s": "throughput/tokens_per_s",
    "mfu": "throughput/mfu",
    "step_time_s": "time/step_s",
    "time_data_s": "time/data_s",
    "time_forward_s": "time/forward_s",
    "time_backward_s": "time/backward_s",
    "time_comm_s": "time/comm_s",
    "time_optimizer_s": "time/optimizer_s",
    "time_other_s": "time/other_s",
    "straggler_spread": "ranks/straggler_spread",
    "pp_bubble_measured": "time/pp_bubble_measured",
}
# per-rank lists -> one tag per rank
RANK_TAGS = {"peak_mem_bytes_per_rank": "memory/peak_bytes", "busy_s_per_rank": "ranks/busy_s"}


class TensorBoardSink:
    def __init__(self, log_dir: Path, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops events logged after a checkpoint that a resumed run recomputes
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def write(self, record: dict) -> None:
        step = record.get("step")
        if step is None:
            return
        for key, tag in TAGS.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(tag, float(value), step)
        for key, tag in RANK_TAGS.items():
            for rank, value in enumerate(record.get(key) or ()):
                self._writer.add_scalar(f"{tag}/rank{rank}", float(value), step)
        for i, sample in enumerate(record.get("samples") or ()):  # train.sample_prompts' answers, as text
            self._writer.add_text(f"samples/prompt{i}", f"{sample['prompt']}\n\n{sample['answer']}", step)

    def close(self, summary: dict | None = None, end: str = "finished") -> None:
        self._writer.flush()
        self._writer.close()
